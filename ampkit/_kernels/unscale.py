"""Unscaling and checking gradients: one fused pass per group, the C kernels where they apply.

The decision whether gradients overflowed is made here (a per-device flag, no host sync) and
handed to the loss scaler (``_run/scaler.py``).
"""
import sys

import torch

from . import native

__all__ = ["copy_unscale_and_check_", "unscale_and_check_"]


CACHE_BLOCK = 2**18  # elements per CPU block: 1 MiB of fp32 and 512 KiB of half, read back from L2


def _flag(found_inf: dict, device: torch.device) -> torch.Tensor:
    flag = found_inf.get(device)
    if flag is None:
        flag = found_inf[device] = torch.zeros(1, dtype=torch.float32, device=device)
    return flag


def _checkable(grad: torch.Tensor) -> torch.Tensor:
    """The dense real tensor that holds ``grad``'s numbers (sparse: its values, complex: a real view)."""
    if grad.is_sparse:
        grad = grad._values()
    return torch.view_as_real(grad) if grad.is_complex() else grad


def _local_shards(tensors) -> list:
    """Each DTensor (an FSDP2 gradient) as this rank's shard; other tensors as they are. The
    found-inf flags are agreed across ranks afterwards."""
    module = sys.modules.get("torch.distributed.tensor")  # not imported: there are no DTensors
    dtensor = getattr(module, "DTensor", None)
    if dtensor is None:
        return tensors
    with torch.no_grad():
        return [t.to_local() if isinstance(t, dtensor) else t for t in tensors]


def unscale_and_check_(grads, inv_scale: float, found_inf: dict) -> None:
    """Multiply ``grads`` by ``inv_scale`` in place and flag non-finite values.

    ``found_inf`` maps a device to a one-element float tensor that is set to 1 when any
    gradient on that device holds an inf or NaN. One fused foreach kernel runs per
    (device, dtype) group; nothing synchronises with the host.
    """
    groups = {}
    for g in map(_checkable, _local_shards(grads)):
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), group in groups.items():
        if inv_scale == 1.0 and device.type == "cpu":
            group = _check_without_unscaling(group, _flag(found_inf, device))
        if group:
            inv = torch.full((), inv_scale, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, _flag(found_inf, device), inv)


EXPONENT = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F800000}  # all ones: inf or NaN


def _check_without_unscaling(group: list, flag: torch.Tensor) -> list:
    """Flag the non-finite values of the large contiguous CPU tensors of ``group`` with one
    read each (the C kernel: unscaling by 1 would write them back unchanged); returns the
    tensors left to the unscaling kernel (all of them without the C kernels)."""
    lib = native.library()
    if lib is None or group[0].dtype not in EXPONENT:
        return group

    def fits(g):
        return g.is_contiguous() and g.numel() >= native.MIN_PER_THREAD

    exp, size = EXPONENT[group[0].dtype], group[0].element_size()
    if any(lib.any_nonfinite(native.ptr(g), g.numel(), size, exp, native.threads(g.numel()))
           for g in group if fits(g)):  # reads only: it may stop at the first non-finite tensor
        flag.fill_(1.0)
    return [g for g in group if not fits(g)]


def _widen_and_unscale(dst: list, src: list, inv_scale: float, flag: torch.Tensor):
    """``dst[i] = src[i] * inv_scale`` for the large contiguous half ``src`` into float32 ``dst``,
    each in one pass of the C kernel that flags the non-finite results; returns the pairs
    left to torch's copy-and-unscale kernels (all of them without the C kernels)."""
    lib = native.library()

    def fits(d, s):
        return (s.dtype in (torch.bfloat16, torch.float16) and d.dtype == torch.float32 and d.is_contiguous()
                and s.is_contiguous() and d.numel() == s.numel() >= native.MIN_PER_THREAD)

    if lib is None:
        return dst, src
    found = [lib.widen_scaled(native.ptr(s), native.ptr(d), s.numel(), s.dtype == torch.float16,
                              inv_scale, native.threads(s.numel()))
             for d, s in zip(dst, src) if fits(d, s)]  # every pair written, whatever the first ones hold
    if any(found):
        flag.fill_(1.0)
    left = [(d, s) for d, s in zip(dst, src) if not fits(d, s)]
    return [d for d, _ in left], [s for _, s in left]


def copy_unscale_and_check_(dst, src, inv_scale: float, found_inf: dict) -> None:
    """``dst[i] = src[i] * inv_scale`` (half gradients into fp32 buffers), flagging
    non-finite values in ``found_inf`` as `unscale_and_check_` does.

    A fused copy then a fused unscale-and-check, per device. On CPU they alternate block
    by block (about ``CACHE_BLOCK`` elements each), so the check reads what the copy has
    just written from cache instead of memory.
    """
    groups = {}
    for d, s in zip(dst, src):
        pair = groups.setdefault(d.device, ([], []))
        pair[0].append(d)
        pair[1].append(s)
    for device, (ds, ss) in groups.items():
        flag = _flag(found_inf, device)
        if device.type == "cpu":
            ds, ss = _widen_and_unscale(ds, ss, inv_scale, flag)
        inv = torch.full((), inv_scale, dtype=torch.float32, device=device)
        for block_d, block_s in (_cache_blocks(ds, ss) if device.type == "cpu" else [(ds, ss)]):
            torch._foreach_copy_(block_d, block_s)
            torch._amp_foreach_non_finite_check_and_unscale_(block_d, flag, inv)


def _cache_blocks(dst, src):
    """The ``(dst, src)`` pairs regrouped into lists of about ``CACHE_BLOCK`` elements;
    contiguous pairs larger than a block are split into flat views."""
    block_d, block_s, n = [], [], 0
    for d, s in zip(dst, src):
        if d.numel() > CACHE_BLOCK and d.is_contiguous() and s.is_contiguous():
            pieces = zip(torch.split(d.view(-1), CACHE_BLOCK), torch.split(s.view(-1), CACHE_BLOCK))
        else:
            pieces = ((d, s),)
        for pd, ps in pieces:
            block_d.append(pd)
            block_s.append(ps)
            n += pd.numel()
            if n >= CACHE_BLOCK:
                yield block_d, block_s
                block_d, block_s, n = [], [], 0
    if block_d:
        yield block_d, block_s
