"""Data-parallel mixed-precision training with ampkit on torch.distributed.

    torchrun --standalone --nproc_per_node 2 examples/distributed/train.py --opt-level O5

Runs on CPUs (gloo) and, unchanged, on GPUs (NCCL, one GPU per process). The data is
synthetic: every rank draws its own batches of one fixed random classification task.
"""
import argparse
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit.parallel import convert_syncbn_model


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    )


def train(args, device: torch.device) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    # Order: BatchNorm -> SyncBatchNorm, then initialize, which wraps in DistributedDataParallel.
    model = convert_syncbn_model(make_model()).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer = ampkit.initialize(model, optimizer, opt_level=args.opt_level, ddp=True, verbosity=int(rank == 0))

    teacher = torch.randn(3 * 8 * 8, 10, generator=torch.Generator().manual_seed(0))
    samples = torch.Generator().manual_seed(1000 + rank)
    for step in range(args.steps):
        x = torch.randn(args.batch_size, 3, 8, 8, generator=samples)
        y = (x.flatten(1) @ teacher).argmax(1)
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        with ampkit.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            if rank == 0:
                print(f"step {step:4d}  loss {mean_loss.item() / world_size:.4f}", flush=True)

    flat = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    if rank == 0:
        print(f"parameters identical on all {world_size} ranks: {all(torch.equal(g, flat) for g in gathered)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O1", choices=sorted(ampkit.OPT_LEVELS))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per process and step")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    train(args, device)
    # DDP models sit in reference cycles: free them before their process group goes (a
    # DDP model outliving destroy_process_group can abort the process at exit).
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
