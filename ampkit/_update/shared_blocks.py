"""8-bit state blocks laid on the full parameter, and the maxima of blocks split between shards.

Element ``g`` of a parameter's flat full tensor is in block ``g // BLOCK`` whatever the
sharding; a block split between FSDP2 shards takes its maximum over all of them
(`share_block_maxima_`), so any sharding stores the unsharded codes and scales. Tensors not
laid out as FSDP2 lays them keep blocks of their own. Design notes: docs/design/update-engine.md.
"""
import functools
import math
from typing import List, Tuple

import torch

from .._kernels.blockquant import num_blocks
from .._run.overflow import collective_device
from .shards import block_index, is_dtensor

__all__ = ["block_first", "split_blocks", "share_block_maxima_", "whole_blocks"]


def block_first(t: torch.Tensor) -> int:
    """Where the blocks of ``local(t)`` start: the global index of its element 0 when ``t`` is
    laid on its full tensor (see the module's docstring), else 0 (its own blocks)."""
    plan = _plan(t)
    return 0 if plan is None else plan[0]


def split_blocks(t: torch.Tensor, block: int) -> Tuple[int, ...]:
    """The global indices of the blocks of ``t``'s full tensor that more than one shard holds
    a part of (the same on every rank), in order; none for an unsharded or unlaid tensor."""
    plan = _plan(t)
    return () if plan is None else _split(plan[2], block)


def whole_blocks(t: torch.Tensor, block: int) -> bool:
    """Whether each block of ``t``'s full tensor lies in one part of it, so that every part's
    block maxima are the full tensor's: a plain tensor, or a DTensor laid on its full tensor
    with no block split (its non-empty parts, which tile the flat tensor in order, all start
    on a block boundary). Read from every part's run, so the same on every rank."""
    if not is_dtensor(t):
        return True
    plan = _plan(t)
    return plan is not None and not _split(plan[2], block)


def share_block_maxima_(absmax: torch.Tensor, items: List[Tuple[torch.Tensor, int]], block: int) -> None:
    """Make each split block's entry of flat float32 ``absmax`` the maximum over every rank's
    part of that block. ``items``: ``(t, at)``, the maxima of the blocks that ``local(t)``
    touches lie in ``absmax`` from ``at`` on (from global block ``block_first(t) // block``).
    Collective: every rank of each tensor's process group calls it with the same tensors in
    the same order (their parts may be empty); one ``all_reduce(MAX)`` per group, none when
    no block is split."""
    by_group = {}
    for t, at in items:
        plan = _plan(t)
        blocks = () if plan is None else _split(plan[2], block)
        if blocks:
            by_group.setdefault(_group(t), []).append((blocks, plan[0], plan[1], at))
    for group, entries in by_group.items():
        slots, where, n = [], [], 0
        for blocks, first, numel, at in entries:
            start, held = first // block, num_blocks(numel, block, first)
            for b in blocks:
                if 0 <= b - start < held:
                    slots.append(n)
                    where.append(at + b - start)
                n += 1
        shared = torch.zeros(n, dtype=torch.float32, device=absmax.device)  # 0: no part here
        slots, where = (torch.tensor(i, dtype=torch.int64, device=absmax.device) for i in (slots, where))
        shared.index_copy_(0, slots, absmax.index_select(0, where))
        _all_reduce_max_(shared, group)
        absmax.index_copy_(0, where, shared.index_select(0, slots))


def _all_reduce_max_(t: torch.Tensor, group) -> None:
    """``all_reduce(MAX)`` of ``t`` over ``group``, on `collective_device` (through the
    accelerator when ``t`` is on the host, CPU offload, and the group is NCCL's alone)."""
    dist = torch.distributed
    on = t.to(collective_device(t.device, group))
    dist.all_reduce(on, op=dist.ReduceOp.MAX, group=group)
    if on is not t:
        t.copy_(on)


def _plan(t: torch.Tensor):
    """``(first, numel, runs)`` of a DTensor laid on its full tensor: this rank's part (its
    first global index and size) and every part's ``(first, numel)`` along the sharded mesh
    dimension; None otherwise."""
    if not is_dtensor(t):
        return None
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    plan = _runs(tuple(t.shape), tuple(mesh.shape), tuple(t.placements))
    if plan is None:
        return None
    dim, runs = plan
    return runs[coordinate[dim]] + (runs,)


@functools.lru_cache(maxsize=None)
def _runs(shape: tuple, mesh_shape: tuple, placements: tuple):
    """``(mesh dim, [(first, numel)] per coordinate along it)`` for a tensor sharded along one
    mesh dimension whose every part is one run of the flat full tensor; None otherwise."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    sharded = [d for d, p in enumerate(placements) if not isinstance(p, Replicate)]
    if len(sharded) != 1 or type(placements[sharded[0]]) is not Shard:
        return None
    dim, runs = sharded[0], []
    for r in range(mesh_shape[dim]):
        coordinate = [0] * len(mesh_shape)
        coordinate[dim] = r
        local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, coordinate, placements)
        first = block_index(tuple(local), shape, tuple(offset))  # an empty part: where it would start
        if not isinstance(first, int):
            return None
        runs.append((first, math.prod(local)))
    return dim, tuple(runs)


@functools.lru_cache(maxsize=None)
def _split(runs: tuple, block: int) -> Tuple[int, ...]:
    """The blocks that more than one of ``runs`` (``(first, numel)``) holds a part of."""
    holders = {}
    for first, numel in runs:
        if numel:
            for b in {first // block, (first + numel - 1) // block}:  # a run's inner blocks are its own
                holders[b] = holders.get(b, 0) + 1
    return tuple(sorted(b for b, n in holders.items() if n > 1))


def _group(t: torch.Tensor):
    """The process group of ``t``'s sharded mesh dimension."""
    from torch.distributed.tensor import Replicate

    dim = next(d for d, p in enumerate(t.placements) if not isinstance(p, Replicate))
    return t.device_mesh.get_group(dim)
