"""A small job that finishes, prints and destroys its process group, as most torchrun scripts end.

    torchrun --standalone --nproc_per_node 2 benchmarks/exit_job.py ddp|fsdp [CHECKPOINT_DIR]

``ddp``: a few O1 steps through ampkit's ``DistributedDataParallel``; ``fsdp``: a few O5 steps
with ``initialize(..., fsdp=True)``, then a sharded save to ``CHECKPOINT_DIR``. Launched many
times by ``benchmarks/exit_soak.py``, which counts the launches that do not exit 0.
"""
import sys

import torch
import torch.distributed as dist
from torch import nn

import ampkit
from ampkit.parallel import DistributedDataParallel, save_sharded


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def steps(net: nn.Module, optimizer, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        optimizer.zero_grad()
        loss = net(torch.randn(8, 16, generator=g)).float().square().mean()
        with ampkit.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    return loss.detach()


def main(kind: str, checkpoint_dir: str = "") -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    net = model()
    if kind == "ddp":
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        net, optimizer = ampkit.initialize(net, optimizer, opt_level="O1", verbosity=0)
        net = DistributedDataParallel(net)
    else:
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
        net, optimizer = ampkit.initialize(net, optimizer, opt_level="O5", fsdp=True, verbosity=0)
    loss = steps(net, optimizer, rank)
    if kind == "fsdp":
        save_sharded(checkpoint_dir, net, optimizer)
    losses = [torch.empty_like(loss) for _ in range(dist.get_world_size())]
    dist.all_gather(losses, loss)
    print(f"rank {rank}: {kind} done, losses {[round(x.item(), 4) for x in losses]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
