"""FSDP2 benchmarks on 2 ranks: per-rank peak memory and step time, table to stdout, JSON to a file.

    python benchmarks/fsdp.py [--quick] [--json PATH] [--device cpu|cuda]

1. memory: per-rank peak memory of O5 on FSDP2 (``initialize(..., fsdp=True)``) vs O5 on DDP
   (``initialize(..., ddp=True)``), AdamW, a transformer LM of >= 50M parameters; each variant
   in 2 fresh processes. Peak = the rise of the RSS high-water mark (CUDA: of the peak
   allocated memory) from before the model is built. Target: FSDP2 <= 0.6x DDP.
2. step time: ampkit O5 on FSDP2 vs a hand-written ``fully_shard`` + ``MixedPrecisionPolicy``
   loop on the same model, both in the same 2 processes, alternating step by step. Target:
   median ratio <= 1.02.

Processes join with gloo on CPU, NCCL on CUDA (one GPU per rank; not run on CPU-only
machines). ``--quick`` shrinks the model to check that everything runs; its figures are not
valid for the targets.
"""
import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from statistics import median

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ampkit
from ampkit.demo import MemoryMeter, machine
from ampkit.demo_models import Block, LMConfig, TinyLM, lm_batches, lm_loss

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import table  # noqa: E402  (benchmarks/run.py: the same table format)

FULL = dict(lm=LMConfig(vocab=256, d_model=1024, n_heads=8, n_layers=4, seq_len=32, batch=2), memory_steps=3,
            speed_steps=8, warmup=2)
QUICK = dict(lm=LMConfig(vocab=256, d_model=128, n_heads=4, n_layers=2, seq_len=16, batch=2), memory_steps=2,
             speed_steps=2, warmup=1)
WORLD = 2


def _device(rank, device_type):
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _worker(rank, fn, tmp, device_type, threads, args):
    torch.set_num_threads(threads)
    device = _device(rank, device_type)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"file://{tmp}/store",
                            rank=rank, world_size=WORLD, timeout=datetime.timedelta(minutes=30))
    torch.save(fn(rank, device, *args), f"{tmp}/{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def launch(fn, device_type, threads, *args):
    """``fn(rank, device, *args)`` on 2 fresh processes; every rank's return value."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(fn, tmp, device_type, threads, args), nprocs=WORLD, join=True)
        return [torch.load(f"{tmp}/{r}.pt", weights_only=False) for r in range(WORLD)]


def _ampkit_fsdp(cfg, device):
    torch.manual_seed(0)
    model = TinyLM(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return ampkit.initialize(model, opt, opt_level="O5", verbosity=0, fsdp=True, fsdp_kwargs={"blocks": [Block]})


def _ampkit_ddp(cfg, device):
    torch.manual_seed(0)
    model = TinyLM(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return ampkit.initialize(model, opt, opt_level="O5", verbosity=0, ddp=True)


def _hand_fsdp(cfg, device):
    """What a user writes without ampkit: fully_shard per block and on the root, bf16 compute,
    fp32 reduction, fp32 output."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = TinyLM(cfg).to(device)
    for block in model.blocks:
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                      output_dtype=torch.float32))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _ampkit_step(model, opt, x, y):
    opt.zero_grad()
    with ampkit.scale_loss(lm_loss(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()


def _hand_step(model, opt, x, y):
    opt.zero_grad()
    lm_loss(model(x), y).backward()
    opt.step()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def memory_worker(rank, device, variant, cfg, steps):
    meter = MemoryMeter(device)
    model, opt = (_ampkit_fsdp if variant == "fsdp" else _ampkit_ddp)(cfg, device)
    params = sum(p.numel() for p in TinyLM(cfg).parameters()) if rank == 0 else None
    for x, y in lm_batches(cfg, steps, seed=rank):
        _ampkit_step(model, opt, x.to(device), y.to(device))
    _sync(device)
    return {"peak_mib": meter.peak_mib(), "params": params}


def speed_worker(rank, device, cfg, steps, warmup):
    runs = {"ampkit": (*_ampkit_fsdp(cfg, device), _ampkit_step), "hand": (*_hand_fsdp(cfg, device), _hand_step)}
    times = {k: [] for k in runs}
    for i, (x, y) in enumerate(lm_batches(cfg, warmup + steps, seed=rank)):
        x, y = x.to(device), y.to(device)
        for name, (model, opt, step) in (runs.items() if i % 2 == 0 else reversed(runs.items())):
            _sync(device)
            start = time.perf_counter()
            step(model, opt, x, y)
            _sync(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def bench_memory(cfg, device_type, threads):
    rows = {}
    for variant in ("ddp", "fsdp"):
        ranks = launch(memory_worker, device_type, threads, variant, cfg["lm"], cfg["memory_steps"])
        rows[variant] = {"variant": f"O5 on {variant.upper() if variant == 'ddp' else 'FSDP2'}",
                         "peak_mib_per_rank": [r["peak_mib"] for r in ranks], "params": ranks[0]["params"]}
    ratio = max(rows["fsdp"]["peak_mib_per_rank"]) / max(rows["ddp"]["peak_mib_per_rank"])
    return {"lm": str(cfg["lm"]), "params": rows["ddp"]["params"], "rows": list(rows.values()), "fsdp_vs_ddp": ratio}


def bench_speed(cfg, device_type, threads):
    ranks = launch(speed_worker, device_type, threads, cfg["lm"], cfg["speed_steps"], cfg["warmup"])
    t = ranks[0]  # steps end on a barrier: every rank sees the same step times
    ratios = [a / h for a, h in zip(t["ampkit"], t["hand"])]
    return {"lm": str(cfg["lm"]), "ampkit_ms": 1e3 * median(t["ampkit"]), "hand_ms": 1e3 * median(t["hand"]),
            "ratio": median(ratios), "ratio_per_step": ratios, "steps": len(ratios)}


def report(results, quick):
    m, s = results["memory"], results["speed"]
    out = [f"\n1. Per-rank peak memory, O5, AdamW, 2 ranks (LM {m['params'] / 1e6:.1f}M params)",
           table(m["rows"], [("variant", "variant", "{}"),
                             ("rank 0 MiB", lambda r: r["peak_mib_per_rank"][0], "{:.0f}"),
                             ("rank 1 MiB", lambda r: r["peak_mib_per_rank"][1], "{:.0f}")]),
           f"FSDP2 / DDP (larger rank of each): {m['fsdp_vs_ddp']:.2f}x",
           f"\n2. Step time on FSDP2, O5, 2 ranks ({s['steps']} steps per variant, alternating)",
           table([s], [("ampkit ms", "ampkit_ms", "{:.1f}"), ("hand-written ms", "hand_ms", "{:.1f}"),
                       ("median ratio", "ratio", "{:.3f}")])]
    targets = check_targets(results)
    out += ["\nTargets" + (" (--quick: sizes too small, not valid for the targets)" if quick else ""),
            table(targets, [("target", "target", "{}"), ("measured", "measured", "{}"), ("met", "met", "{}")])]
    return "\n".join(out)


def check_targets(results):
    m, s = results["memory"], results["speed"]
    return [
        {"target": "per-rank peak memory FSDP2-O5 <= 0.6x DDP-O5 (>= 50M params)",
         "measured": f"{m['fsdp_vs_ddp']:.2f}x ({m['params'] / 1e6:.1f}M)", "met": m["fsdp_vs_ddp"] <= 0.6 and m["params"] >= 50e6},
        {"target": "step time ampkit FSDP2-O5 / hand-written fully_shard <= 1.02", "measured": f"{s['ratio']:.3f}",
         "met": s["ratio"] <= 1.02},
    ]


def main(argv=None):
    p = argparse.ArgumentParser(description="ampkit FSDP2 benchmarks (2 ranks)")
    p.add_argument("--quick", action="store_true", help="a small model: a smoke run, not valid for the targets")
    p.add_argument("--json", metavar="PATH", help="write machine, config and results as JSON")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = p.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < WORLD:
        p.error(f"--device cuda needs {WORLD} GPUs")
    cfg = QUICK if args.quick else FULL
    info = machine(torch.device(args.device))
    print(f"ampkit {ampkit.__version__} FSDP2 benchmarks{' --quick' if args.quick else ''}: {info}", flush=True)
    started = time.perf_counter()
    results = {"memory": bench_memory(cfg, args.device, args.threads), "speed": bench_speed(cfg, args.device, args.threads)}
    print(report(results, args.quick))
    print(f"\nload average (1 min): {info['load_average']:.2f} at the start, {os.getloadavg()[0]:.2f} at the end, "
          f"on {info['cores']} cores; more than the core count means other work shared the CPUs.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "load_average_end": os.getloadavg()[0], "argv": sys.argv, "quick": args.quick,
                       "seconds": time.perf_counter() - started, "results": results,
                       "targets": check_targets(results)}, f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
