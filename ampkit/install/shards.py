"""A sharded (DTensor) tensor's local part, and local tensors wrapped back as DTensors.

FSDP2 shards parameters as DTensors. ampkit's elementwise kernels (fused flat copies,
stochastic rounding, the remainder split and combine) run on each rank's local shard;
what an optimizer steps on is wrapped back with its parameter's mesh and placements, so
its state is DTensor too (what ``torch.distributed.checkpoint`` saves as shards). On plain
tensors every function here is the identity.
"""
import torch


def is_dtensor(t) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (its storage, not a copy); ``t`` itself if it is not a DTensor."""
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        return t.to_local()


def like(part: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``part`` (a local tensor) as a DTensor sharded like ``ref`` (sharing ``part``'s storage);
    ``part`` itself when ``ref`` is not a DTensor."""
    if not is_dtensor(ref):
        return part
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(part, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape,
                              stride=ref.stride())


def shard_of(whole: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``whole`` (a tensor of ``ref``'s global shape), cut as ``ref`` is;
    the first rank's ``whole`` counts (collective when ``ref`` is a DTensor)."""
    if not is_dtensor(ref):
        return whole
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole.detach(), ref.device_mesh, ref.placements).to_local()
