"""Tiny models and data shared by the distributed tests (parent and workers build the same)."""
import torch
import torch.nn.functional as F
from torch import nn

import ampkit


class Net(nn.Module):
    """4 -> 6 -> BatchNorm -> tanh -> 3."""

    def __init__(self, norm=nn.BatchNorm1d):
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.bn = norm(6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def make_net(seed=0, dtype=torch.float32, norm=nn.BatchNorm1d) -> Net:
    """Linear layers in ``dtype``; the BatchNorm stays float32 (mixed, as at O2/O5)."""
    torch.manual_seed(seed)
    net = Net(norm).to(dtype)
    net.bn.float()
    return net


def batches(world_size, steps=3, per_rank=4, seed=1):
    """``steps`` global batches ``(x, y)`` of ``world_size * per_rank`` samples."""
    g = torch.Generator().manual_seed(seed)
    n = world_size * per_rank
    return [(torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)) for _ in range(steps)]


def shard(batch, rank, world_size):
    """This rank's consecutive slice of a global batch."""
    return tuple(t.chunk(world_size)[rank] for t in batch)


def params(model):
    return [p.detach().float().clone() for p in model.parameters()]


def micro_batches(steps, micro, per_rank=4, rank=None, world_size=2):
    """Per step, ``micro`` micro-batches ``(x, y)`` (4 -> 3): rank ``rank``'s slice of each, or (one
    process, ``rank=None``) all ranks' samples together."""
    g = torch.Generator().manual_seed(1)
    n = world_size * per_rank
    data = [[(torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)) for _ in range(micro)] for _ in range(steps)]
    if rank is None:
        return data
    return [[shard(batch, rank, world_size) for batch in step] for step in data]


def train_steps(net, opt, data) -> None:
    """One ampkit step per step of ``data`` (`micro_batches` with one micro-batch): the mean
    squared error of ``net``'s output in float32, backward through ``scale_loss``."""
    for ((x, y),) in data:
        opt.zero_grad()
        with ampkit.scale_loss(F.mse_loss(net(x).float(), y), opt) as scaled:
            scaled.backward()
        opt.step()
