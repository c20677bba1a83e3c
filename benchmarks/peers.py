"""Other libraries' low-memory bf16 optimizers, for ``benchmarks/frontier.py`` and the update family
(``benchmarks/families/update.py``): constructors and byte counting.

Every peer trains the model cast to bfloat16 (weights, gradients and activations in bf16) with its own
optimizer, called through its public API with AdamW's hyperparameters as ampkit's variants get them
(``torch.optim.AdamW`` defaults: betas (0.9, 0.999), eps 1e-8, weight decay 0.01):

- ``plain bf16 (control)``: ``torch.optim.AdamW`` on the bf16 weights (bf16 state, round-to-nearest update);
- ``torchao AdamW SR``: ``torchao.optim._AdamW(bf16_stochastic_round=True)`` (state in the weights' dtype,
  so bf16; the update stochastically rounded to bf16; every parameter's step is ``torch.compile``-d);
- ``torchao AdamW8bit SR``: ``torchao.optim.AdamW8bit(bf16_stochastic_round=True)`` (block-quantized 8-bit
  state for tensors of >= 4096 elements, bf16 state for the rest);
- ``optimi AdamW Kahan``: ``optimi.AdamW(kahan_sum=True)`` (bf16 state plus a bf16 Kahan compensation buffer);
- ``bnb AdamW8bit``: ``bitsandbytes.optim.AdamW8bit`` (8-bit blockwise state for tensors of >= 4096 elements,
  fp32 state for the rest; round-to-nearest update).

And SGD with momentum (``SGD_PEERS``, the update family), with the ImageNet recipe's hyperparameters
(momentum 0.9, no dampening, weight decay 5e-4 as an L2 term, no Nesterov):

- ``plain bf16 SGD (control)``: ``torch.optim.SGD`` on the bf16 weights (bf16 momentum, round-to-nearest update);
- ``bnb SGD8bit``: ``bitsandbytes.optim.SGD8bit`` (8-bit blockwise momentum for tensors of >= 4096 elements);
- ``optimi SGD Kahan``: ``optimi.SGD(kahan_sum=True, torch_init=True)`` (bf16 momentum started from the
  first gradient as torch's is, plus a bf16 Kahan compensation buffer).
"""
import importlib

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

ADAMW = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def _plain(params, lr):
    return torch.optim.AdamW(params, lr=lr, **ADAMW)


def _torchao(params, lr):
    from torchao.optim import _AdamW
    return _AdamW(params, lr=lr, bf16_stochastic_round=True, **ADAMW)


def _torchao8(params, lr):
    from torchao.optim import AdamW8bit
    return AdamW8bit(params, lr=lr, bf16_stochastic_round=True, **ADAMW)


def _optimi(params, lr):
    import optimi
    return optimi.AdamW(params, lr=lr, kahan_sum=True, **ADAMW)


def _bnb(params, lr):
    import bitsandbytes
    return bitsandbytes.optim.AdamW8bit(params, lr=lr, **ADAMW)


PEERS = {  # name: (module it needs, constructor(params, lr))
    "plain bf16 (control)": ("torch", _plain),
    "torchao AdamW SR": ("torchao.optim", _torchao),
    "torchao AdamW8bit SR": ("torchao.optim", _torchao8),
    "optimi AdamW Kahan": ("optimi", _optimi),
    "bnb AdamW8bit": ("bitsandbytes", _bnb),
}
COMPILED = ("torchao AdamW SR", "torchao AdamW8bit SR")  # their first step compiles

SGD = dict(momentum=0.9, dampening=0.0, weight_decay=5e-4, nesterov=False)  # the ImageNet recipe's SGD


def _plain_sgd(params, lr):
    return torch.optim.SGD(params, lr=lr, **SGD)


def _bnb_sgd(params, lr):
    import bitsandbytes
    return bitsandbytes.optim.SGD8bit(params, lr=lr, **SGD)


def _optimi_sgd(params, lr):
    import optimi
    return optimi.SGD(params, lr=lr, momentum=SGD["momentum"], weight_decay=SGD["weight_decay"], torch_init=True,
                      kahan_sum=True)


SGD_PEERS = {  # name: (module it needs, constructor(params, lr))
    "plain bf16 SGD (control)": ("torch", _plain_sgd),
    "bnb SGD8bit": ("bitsandbytes", _bnb_sgd),
    "optimi SGD Kahan": ("optimi", _optimi_sgd),
}


def unavailable(module):
    """Why ``module`` does not import here, or None."""
    try:
        importlib.import_module(module)
    except Exception as e:  # ImportError, or a library that fails while loading its backend
        return f"{module} does not import: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def missing(name):
    """Why peer ``name`` cannot run here (its library does not import), or None."""
    return unavailable({**PEERS, **SGD_PEERS}[name][0])


def make(name, model, lr):
    """Peer ``name``'s optimizer over ``model`` (already bf16)."""
    return {**PEERS, **SGD_PEERS}[name][1](model.parameters(), lr)


def _leaves(t):
    """The plain tensors that hold ``t``'s data: ``t``, or a wrapper subclass's inner tensors (torchao's 8-bit state)."""
    if is_traceable_wrapper_subclass(t):
        for attr in t.__tensor_flatten__()[0]:
            yield from _leaves(getattr(t, attr))
    else:
        yield t


def state_bytes(model, opt):
    """Persistent bytes, each storage once, in ``ampkit.footprint.persistent_bytes``'s keys: ``weights``
    (the model's parameters), ``buffers`` (the model's buffers), ``masters`` (tensors in the optimizer's
    param groups that are not the model's parameters), ``optimizer_state`` (every tensor in the optimizer's
    state, wrapper subclasses counted by their inner tensors: codes, scales, quantization maps, Kahan
    buffers), ``total``; ``params`` (parameter count) and ``optimizer_scalars`` (one-element state tensors:
    step counters). Not counted: gradients, activations, non-tensor state (bitsandbytes' int step),
    hyperparameters held as tensors (torchao's lr)."""
    seen = {}

    def new(tensors):
        added = 0
        for t in tensors:
            for leaf in _leaves(t):
                s = leaf.untyped_storage()
                if s.data_ptr() not in seen:
                    seen[s.data_ptr()] = s.nbytes()
                    added += s.nbytes()
        return added

    params = list(model.parameters())
    state = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    kinds = {"weights": new(params), "buffers": new(model.buffers()),
             "masters": new(p for g in opt.param_groups for p in g["params"]), "optimizer_state": new(state)}
    kinds["total"] = sum(kinds.values())
    kinds["params"] = sum(p.numel() for p in params)
    kinds["optimizer_scalars"] = sum(v.untyped_storage().nbytes() for v in state
                                     if v.numel() == 1 and not is_traceable_wrapper_subclass(v))
    return kinds
