"""BatchNorm whose training statistics span every rank of a process group.

Torch's ``nn.SyncBatchNorm`` only synchronises CUDA-like devices (its kernels have no
CPU version), so elsewhere the exchange is done here with ``torch.distributed``
collectives: one ``all_gather`` of per-rank (count, mean, M2) in forward, merged
exactly for unequal batch sizes, and one ``all_reduce`` of (sum dy, sum dy*(x-mean)) in
backward.
"""
import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable
from torch.nn.modules._functions import SyncBatchNorm as _NativeSyncBatchNorm  # what nn.SyncBatchNorm applies
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["SyncBatchNorm", "convert_syncbn_model", "create_syncbn_process_group"]

_NATIVE_DEVICES = ("cuda", "hpu", "xpu", torch._C._get_privateuse1_backend_name())


def _channel_view(t: torch.Tensor, ndim: int) -> torch.Tensor:
    return t.view(1, -1, *([1] * (ndim - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm over the union of every rank's batch (any device)."""

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum, group, world_size):
        dims = [d for d in range(input.dim()) if d != 1]
        x = input.to(torch.promote_types(input.dtype, torch.float32))
        count = input.numel() // input.size(1)
        mean = x.sum(dims) / max(count, 1)
        m2 = (x - _channel_view(mean, x.dim())).square().sum(dims)
        local = torch.cat([mean.new_full((1,), count), mean, m2])
        gathered = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local, group=group)
        counts, means, m2s = torch.stack(gathered).split([1, mean.numel(), mean.numel()], dim=1)
        total = counts.sum()
        if total <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got {int(total)} over all ranks.")
        mean = (counts * means).sum(0) / total
        var = (m2s + counts * (means - mean).square()).sum(0) / total
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            unbiased = var * (total / (total - 1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        scale = invstd if weight is None else invstd * weight
        shift = -mean * scale if bias is None else bias - mean * scale
        out = x * _channel_view(scale, x.dim()) + _channel_view(shift, x.dim())
        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.total, ctx.group, ctx.has_bias = total, group, bias is not None  # bias implies weight
        return out.to(input.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        input, weight, mean, invstd = ctx.saved_tensors
        dims = [d for d in range(input.dim()) if d != 1]
        x = input.to(mean.dtype)
        dy = grad_output.to(mean.dtype)
        xmu = x - _channel_view(mean, x.dim())
        sums = torch.cat([dy.sum(dims), (dy * xmu).sum(dims)])
        local_dy, local_dy_xmu = sums.clone().chunk(2)
        dist.all_reduce(sums, group=ctx.group)
        sum_dy, sum_dy_xmu = sums.chunk(2)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            scale = invstd if weight is None else invstd * weight
            proj = sum_dy_xmu * invstd.square() / ctx.total
            grad_input = (dy - _channel_view(sum_dy / ctx.total, x.dim()) - xmu * _channel_view(proj, x.dim()))
            grad_input = (grad_input * _channel_view(scale, x.dim())).to(input.dtype)
        # Affine gradients stay local, like every other parameter's: DDP reduces them.
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (local_dy_xmu * invstd).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = local_dy.to(weight.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Apex's ``SyncBatchNorm``: in training, statistics over all ranks of ``process_group``.

    Forward and backward both synchronise; running statistics get the unbiased variance
    of the whole group's batch; ranks may hold different batch sizes. In eval mode, or
    without an initialized process group of more than one rank, it is plain BatchNorm.
    Half input with float32 parameters gives output in the input dtype. On CUDA (and the
    other devices ``torch.nn.SyncBatchNorm`` supports) torch's own kernels do the work.
    ``channel_last=True`` computes and returns 4-D/5-D activations in channels-last memory
    format (``torch.channels_last``); either way the channel dimension is dim 1, and any
    memory format is accepted.

    Args:
        num_features: as ``nn.BatchNorm2d``.
        eps: as ``nn.BatchNorm2d``.
        momentum: as ``nn.BatchNorm2d``.
        affine: as ``nn.BatchNorm2d``.
        track_running_stats: as ``nn.BatchNorm2d``.
        process_group: the ranks whose statistics are combined (default: all).
        channel_last: compute and return channels-last activations.
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True, process_group=None, channel_last=False):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group
        self.channel_last = channel_last

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        if input.size(1) != self.num_features:
            raise ValueError(
                f"SyncBatchNorm({self.num_features}): input has {input.size(1)} channels in dim 1 (shape "
                f"{tuple(input.shape)}); channels are dim 1 also for channels-last data (torch.channels_last)."
            )

    def _world_size(self) -> int:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.process_group or dist.group.WORLD)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if self.channel_last and input.dim() in (4, 5):
            input = input.contiguous(memory_format=torch.channels_last if input.dim() == 4 else torch.channels_last_3d)
        world_size = self._world_size()
        if world_size == 1:
            return super().forward(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        function = _NativeSyncBatchNorm if input.device.type in _NATIVE_DEVICES else _SyncBatchNormFunction
        return function.apply(
            input, self.weight, self.bias,
            self.running_mean if self.track_running_stats else None,
            self.running_var if self.track_running_stats else None,
            self.eps, momentum, self.process_group or dist.group.WORLD, world_size,
        )


def convert_syncbn_model(module: torch.nn.Module, process_group=None, channel_last: bool = False) -> torch.nn.Module:
    """Replace every BatchNorm (``_BatchNorm``; InstanceNorm is not one) in ``module`` by `SyncBatchNorm`.

    The new layers reuse the old ones' Parameter objects (optimizers stay valid), running
    statistics and ``num_batches_tracked``, and their train/eval mode. Returns the module
    (a new object if ``module`` itself is a BatchNorm).

    Args:
        module: the model.
        process_group: passed to every new `SyncBatchNorm`.
        channel_last: passed to every new `SyncBatchNorm`.
    """
    out = module
    if isinstance(module, _BatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group, channel_last)
        out.weight, out.bias = module.weight, module.bias
        out.running_mean, out.running_var = module.running_mean, module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, convert_syncbn_model(child, process_group, channel_last))
    return out


def create_syncbn_process_group(group_size: int):
    """Split the world into consecutive groups of ``group_size`` ranks; return this rank's group.

    ``0`` means the whole world (returns None). Every rank must call it (all groups are
    created on every rank, as ``torch.distributed.new_group`` requires).
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 0:
        raise ValueError(f"create_syncbn_process_group(group_size={group_size!r}): expected an integer >= 0.")
    if group_size == 0:
        return None
    world_size = dist.get_world_size()
    if group_size > world_size or world_size % group_size != 0:
        raise ValueError(
            f"create_syncbn_process_group(group_size={group_size}): the world size {world_size} must be a "
            f"multiple of group_size."
        )
    rank, mine = dist.get_rank(), None
    for start in range(0, world_size, group_size):
        group = dist.new_group(ranks=list(range(start, start + group_size)))
        if start <= rank < start + group_size:
            mine = group
    return mine
