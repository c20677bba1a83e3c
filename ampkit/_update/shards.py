"""A sharded (DTensor) tensor's local part, and local tensors wrapped back as DTensors.

FSDP2 shards parameters as DTensors. ampkit's elementwise kernels (fused flat copies,
stochastic rounding, the remainder split and combine) run on each rank's local shard;
what an optimizer steps on is wrapped back with its parameter's mesh and placements, so
its state is DTensor too (what ``torch.distributed.checkpoint`` saves as shards). On plain
tensors every function here is the identity.
"""
import torch


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # never DTensors: answered without two attribute misses


def is_dtensor(t) -> bool:
    return type(t) not in _PLAIN and hasattr(t, "device_mesh") and hasattr(t, "to_local")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (its storage, not a copy); ``t`` itself if it is not a DTensor."""
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        return t.to_local()


def like(part: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``part`` (a local tensor) as a DTensor sharded like ``ref`` (sharing ``part``'s storage);
    ``part`` itself when ``ref`` is not a DTensor. A CPU ``part`` of an accelerator's mesh
    (FSDP2's ``CPUOffloadPolicy``) stays on the CPU, as FSDP2 wraps its own shards there
    (``DTensor.from_local`` would copy it to the mesh's device)."""
    if not is_dtensor(ref):
        return part
    from torch.distributed.tensor import DTensor

    if part.device.type != ref.device_mesh.device_type and not part.is_meta:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        meta = TensorMeta(ref.shape, ref.stride(), part.dtype)
        return DTensor(part, DTensorSpec(ref.device_mesh, tuple(ref.placements), tensor_meta=meta),
                       requires_grad=part.requires_grad)
    return DTensor.from_local(part, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape,
                              stride=ref.stride())


def shard_of(whole: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``whole`` (a tensor of ``ref``'s global shape), cut as ``ref`` is, on
    the device of ``ref``'s local part (the CPU with FSDP2's ``CPUOffloadPolicy``, where the
    mesh is an accelerator's); the first rank's ``whole`` counts (collective when ``ref`` is a
    DTensor)."""
    if not is_dtensor(ref):
        return whole
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole.detach(), ref.device_mesh, ref.placements).to_local().to(local(ref).device)


def global_index(t: torch.Tensor):
    """Where the elements of ``local(t)`` (row-major) sit in ``t``'s full flat tensor: the first
    one's index (an int) when the local part is one run of it (always for unsharded tensors
    and FSDP2's dim-0 shards), else every element's (an int64 tensor of the local shape)."""
    if not is_dtensor(t):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return block_index(tuple(shape), tuple(t.shape), tuple(offset))


def block_index(shape: tuple, whole: tuple, offset: tuple):
    """`global_index` of the block of ``shape`` at ``offset`` in a tensor of shape ``whole``."""
    strides = [1] * len(whole)
    for d in range(len(whole) - 2, -1, -1):
        strides[d] = strides[d + 1] * whole[d + 1]
    first = sum(o * s for o, s in zip(offset, strides))
    lead = next((d for d, n in enumerate(shape) if n != 1), len(shape))  # coordinates fixed before it
    if all(shape[d] == whole[d] for d in range(lead + 1, len(shape))):
        return first
    index = torch.full(shape, first, dtype=torch.int64)
    for d, (n, s) in enumerate(zip(shape, strides)):
        index += (torch.arange(n, dtype=torch.int64) * s).view([n if e == d else 1 for e in range(len(shape))])
    return index
