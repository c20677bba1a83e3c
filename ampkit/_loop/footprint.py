"""Persistent training memory, measured: the bytes of the tensors that live across steps.

Counted, each storage once (shared or tied tensors are not double-counted): the models'
parameters and buffers, the tensors the optimizers step on (fp32 master weights, or the
16-bit remainders of ``master_weights="remainder"`` and their side tables), every
tensor in the optimizers' state, and the fp32 gradient buffers ampkit keeps across steps
for large master sets. Not counted: gradients (call after ``zero_grad()``, which frees
them) and activations, which are per-step. Of a model sharded with FSDP2: this rank's shards.
"""
from typing import Dict, Iterable, List

import torch
from torch import nn

from .._kernels.remainder import side_table
from .._optim.optimizer_wrappers import is_optimizer_like
from .._update.shards import local


def _storages(tensors: Iterable[torch.Tensor]) -> Dict[int, int]:
    out = {}
    for t in tensors:
        if torch.is_tensor(t) and t.device.type != "meta":
            s = local(t).untyped_storage()  # of a DTensor (FSDP2): this rank's shard
            out[s.data_ptr()] = max(out.get(s.data_ptr(), 0), s.nbytes())
    return out


def _listed(call: str, name: str, value, accepts, what: str) -> list:
    """``value`` (one object or a list/tuple of them) as a list; a TypeError naming the argument otherwise."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    rejected = [x for x in items if not accepts(x)]
    if not rejected:
        return items
    bad = rejected[0]
    swapped = (isinstance(bad, nn.Module) if name == "optimizers" else is_optimizer_like(bad))
    raise TypeError(f"{call}({name}=...): expected {what} or a list of them, got {type(bad).__name__}"
                    + (" (the arguments are models, optimizers: swapped?)." if swapped else "."))


def _checked(call: str, models, optimizers):
    return (_listed(call, "models", models, lambda m: isinstance(m, nn.Module), "an nn.Module"),
            _listed(call, "optimizers", optimizers, is_optimizer_like, "an optimizer"))


def persistent_bytes(models: List[nn.Module], optimizers: List[torch.optim.Optimizer]) -> Dict[str, int]:
    """Bytes that ``models`` and ``optimizers`` keep between steps, by kind (``weights``, ``buffers``,
    ``masters``, ``optimizer_state``, ``grad_buffers``) and ``total``; ``params`` is the number of model parameters;
    ``optimizer_scalars`` is the part of ``optimizer_state`` in one-element tensors.
    ``models`` and ``optimizers``: one object or a list of them each (as ``initialize`` takes)."""
    models, optimizers = _checked("persistent_bytes", models, optimizers)
    weights = [p for m in models for p in m.parameters()]
    seen = _storages(weights)
    kinds = {"weights": sum(seen.values())}

    def new(tensors):
        found = {k: v for k, v in _storages(tensors).items() if k not in seen}
        seen.update(found)
        return sum(found.values())

    kinds["buffers"] = new(b for m in models for b in m.buffers())
    remainders = [r for m in models for r in getattr(getattr(m, "_ampkit", None), "remainders", {}).values()]
    tables = [side_table(r) for r in remainders]  # the few values 16 bits cannot hold
    kinds["masters"] = new([p for o in optimizers for g in o.param_groups for p in g["params"]] + remainders + tables)
    kinds["optimizer_state"] = new(v for o in optimizers for st in o.state.values() for v in st.values())
    kinds["grad_buffers"] = new(b for o in optimizers for b in getattr(getattr(o, "_ampkit", None), "_grad_buffers", {}).values())
    kinds["total"] = sum(kinds.values())
    kinds["params"] = sum(local(p).numel() for p in {id(p): p for p in weights}.values())
    kinds["optimizer_scalars"] = sum(  # part of optimizer_state: one-element entries (Adam's step)
        v.untyped_storage().nbytes() for o in optimizers for st in o.state.values() for v in st.values()
        if torch.is_tensor(v) and v.numel() == 1)
    return kinds


def bytes_per_param(models: List[nn.Module], optimizers: List[torch.optim.Optimizer], buffers: bool = False) -> float:
    """Persistent bytes of the weights of ``models``, their masters, the state of ``optimizers`` (and
    ampkit's gradient buffers) per model parameter; model buffers only when ``buffers`` is True.
    ``models`` and ``optimizers``: one object or a list of them each."""
    models, optimizers = _checked("bytes_per_param", models, optimizers)
    b = persistent_bytes(models, optimizers)
    if not b["params"]:
        raise ValueError("bytes_per_param(models=...): the models hold no parameters, so there are no bytes per "
                         "parameter; pass the models the optimizers train.")
    return (b["total"] - (0 if buffers else b["buffers"])) / b["params"]
