"""Sharded (FSDP2) mixed-precision training with ampkit: one model larger than one device's memory.

    torchrun --standalone --nproc_per_node 2 examples/fsdp/train.py --opt-level O5

    # several nodes: the same command on each machine (HOST0: the address of one of them)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \
        --rdzv-id run1 examples/fsdp/train.py --opt-level O7

``initialize(..., fsdp=True)`` applies ``torch.distributed.fsdp.fully_shard`` to every
transformer block and to the root, with the opt level mapped onto FSDP2's
``MixedPrecisionPolicy``. Runs on CPUs (gloo) and, unchanged, on GPUs (NCCL, one GPU per
process). ``--checkpoint-dir`` saves a sharded DCP checkpoint at the end (each rank writes
its shards) and ``--resume`` continues from it, on any number of processes and at any
level; ``--export`` writes one float32 state dict from rank 0 for use without FSDP.
"""
import argparse
import gc
import os

import torch
import torch.distributed as dist

import ampkit
from ampkit._cli.demo_models import Block, LMConfig, TinyLM, lm_batches, lm_loss
from ampkit.parallel import full_state_dict, load_sharded, save_sharded


def train(args, device: torch.device) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cfg = LMConfig(vocab=256, d_model=args.d_model, n_heads=4, n_layers=args.layers, seq_len=32, batch=args.batch_size)
    torch.manual_seed(0)
    model = TinyLM(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # Build the optimizer on the unsharded model; initialize shards it (per Block, then the
    # root) and points the optimizer at the shards.
    model, optimizer = ampkit.initialize(model, optimizer, opt_level=args.opt_level, fsdp=True,
                                         fsdp_kwargs={"blocks": [Block]}, verbosity=int(rank == 0))
    start = 0
    if args.resume:
        load_sharded(args.checkpoint_dir, model, optimizer)
        start = args.steps
    for step, (x, y) in enumerate(lm_batches(cfg, args.steps, seed=1000 * (start + 1) + rank), start):
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        loss = lm_loss(model(x), y)
        with ampkit.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        mean_loss = loss.detach().float()
        dist.all_reduce(mean_loss)
        if rank == 0 and (step % 10 == 0 or step == start + args.steps - 1):
            print(f"step {step:4d}  loss {mean_loss.item() / world_size:.4f}", flush=True)
    if args.checkpoint_dir and not args.resume:
        save_sharded(args.checkpoint_dir, model, optimizer)
        if rank == 0:
            print(f"saved a sharded checkpoint to {args.checkpoint_dir}", flush=True)
    if args.export:
        state = full_state_dict(model)  # collective; the dict is on rank 0
        if rank == 0:
            torch.save(state, args.export)
            print(f"exported {len(state)} float32 tensors to {args.export}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O5", choices=sorted(ampkit.OPT_LEVELS))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per process and step")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoint-dir", help="save a sharded DCP checkpoint here at the end")
    parser.add_argument("--resume", action="store_true", help="load --checkpoint-dir first, then train --steps more")
    parser.add_argument("--export", metavar="PATH", help="write one float32 state dict (rank 0) at the end")
    args = parser.parse_args()
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    train(args, device)
    # The sharded model sits in reference cycles: free it (and its communication state) before
    # the process group goes, so no gloo thread is left running at interpreter exit.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
