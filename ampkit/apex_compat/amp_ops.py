"""``amp_C`` in the stand-in: the common ops of Apex's multi-tensor CUDA extension, on torch's
``_foreach`` ops (any device), with Apex's calling convention and semantics.

Each op is called as Apex's ``multi_tensor_applier`` calls it: ``op(chunk_size, noop_flag,
tensor_lists, *args)``; ``chunk_size`` only sized Apex's CUDA launches and is ignored. As in
Apex, values are computed in float32, written in the output tensors' dtype, and non-finite
values are propagated, not skipped: ``noop_flag`` (an int tensor) is set to 1 when one is
found. Empty lists are left alone. The other amp_C ops fail when called, naming the torch
replacement.
"""
import torch

__all__ = ["multi_tensor_scale", "multi_tensor_axpby", "multi_tensor_l2norm"]


def _flag_nonfinite(noop_flag: torch.Tensor, tensors) -> None:
    """Set ``noop_flag`` to 1 when one of ``tensors`` holds an inf or NaN (no host sync)."""
    if tensors:
        finite = torch.stack([torch.isfinite(t).all().to(noop_flag.device) for t in tensors]).all()
        noop_flag.masked_fill_(~finite, 1)


def _float(tensors):
    return [t.float() for t in tensors]


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``out = in * scale`` for ``tensor_lists = [ins, outs]``; the flag is set for a non-finite input."""
    ins, outs = tensor_lists
    if not ins:
        return
    _flag_nonfinite(noop_flag, ins)
    torch._foreach_copy_(outs, torch._foreach_mul(_float(ins), scale))


_CHECKED = {-1: "both", 0: "x", 1: "y"}


def multi_tensor_axpby(chunk_size, noop_flag, tensor_lists, a, b, arg_to_check):
    """``out = a * x + b * y`` for ``tensor_lists = [xs, ys, outs]``; the flag is set for a
    non-finite ``x`` and/or ``y``, as ``arg_to_check`` says (-1: both, 0: x, 1: y)."""
    if arg_to_check not in _CHECKED:
        raise ValueError(f"amp_C.multi_tensor_axpby(arg_to_check={arg_to_check!r}): expected -1 (check x and y), "
                         f"0 (x) or 1 (y).")
    xs, ys, outs = tensor_lists
    if not xs:
        return
    _flag_nonfinite(noop_flag, {-1: xs + ys, 0: xs, 1: ys}[arg_to_check])
    out = torch._foreach_mul(_float(xs), a)
    torch._foreach_add_(out, torch._foreach_mul(_float(ys), b))
    torch._foreach_copy_(outs, out)


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    """The float32 L2 norm of all of ``tensor_lists[0]`` together, as a 1-element tensor, and
    (``per_tensor=True``) each tensor's norm, else an empty tensor; the flag is set when the
    norm is not finite."""
    tensors = tensor_lists[0]
    if not tensors:
        raise ValueError("amp_C.multi_tensor_l2norm(tensor_lists=...): tensor_lists[0] is empty; "
                         "expected at least one tensor.")
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    total = torch.linalg.vector_norm(norms).reshape(1)
    _flag_nonfinite(noop_flag, [total])
    return total, norms if per_tensor else norms.new_empty(0)


def _not_provided(name: str, instead: str):
    def op(*args, **kwargs):
        raise NotImplementedError(f"amp_C.{name} is not provided by ampkit's Apex stand-in: {instead}.")

    op.__name__ = op.__qualname__ = name
    return op


_NO_LAMB = "torch.optim has no LAMB; see apex.optimizers.FusedLAMB's message"
_INSTEAD = {  # the other ops of Apex's amp_C, and what to use
    "multi_tensor_sgd": "use torch.optim.SGD(params, fused=True) (apex.optimizers.FusedSGD is one here)",
    "multi_tensor_adam": "use torch.optim.AdamW/Adam(params, fused=True) (apex.optimizers.FusedAdam is one here)",
    "multi_tensor_adam_capturable": "use torch.optim.AdamW/Adam(params, fused=True, capturable=True)",
    "multi_tensor_adam_capturable_master": "use amp.initialize(..., opt_level='O2') masters with torch.optim.AdamW",
    "multi_tensor_adagrad": "use torch.optim.Adagrad(params, fused=True) (apex.optimizers.FusedAdagrad is one here)",
    "multi_tensor_novograd": "torch.optim has no NovoGrad; see apex.optimizers.FusedNovoGrad's message",
    "multi_tensor_lamb": _NO_LAMB,
    "multi_tensor_lamb_mp": _NO_LAMB,
    "multi_tensor_lamb_stage1_cuda": _NO_LAMB,
    "multi_tensor_lamb_stage2_cuda": _NO_LAMB,
    "multi_tensor_l2norm_mp": "use torch._foreach_norm(tensors, dtype=torch.float32)",
    "multi_tensor_l2norm_scale": "use torch._foreach_mul(tensors, scale), then torch._foreach_norm",
    "multi_tensor_unscale_l2norm": "use torch._foreach_norm(torch._foreach_mul(tensors, inv_scale))",
    "update_scale_hysteresis": "use torch.amp.GradScaler (no hysteresis) or amp's dynamic loss scale",
}
for _name, _instead in _INSTEAD.items():
    globals()[_name] = _not_provided(_name, _instead)
del _name, _instead
__all__ += list(_INSTEAD)
