"""FSDP2 benchmarks on 2 ranks: per-rank peak memory and step time, table to stdout, JSON to a file.

    python benchmarks/fsdp.py [--quick] [--json PATH] [--device cpu|cuda] [--size auto|full|small]

Progress lines go to stderr (per launch, and rank 0 per step or every 50 steps); each family's wall
time is in its table heading and the JSON (``wall_s``). Where ``ampkit.capabilities()`` calls
bfloat16 emulated, ``--size auto`` (the default) uses the ``EMULATED`` shapes.

1. memory: per-rank peak memory of O5 on FSDP2 (``initialize(..., fsdp=True)``) vs O5 on DDP
   (``initialize(..., ddp=True)``), AdamW, a transformer LM of >= 50M parameters; each variant
   in 2 fresh processes, peaks counted from before the model is built. On CUDA: the peak
   allocated memory. On CPU, three measures, each in its own processes: the peak of the live
   tensor bytes (:class:`LiveBytesMeter`, the CPU counterpart of CUDA's figure and what
   sharding controls; the target is checked on it), and the rise of the RSS high-water mark
   with glibc's default malloc, whose heap keeps freed blocks (allocator retention the gloo
   threads' arenas make worse), and with ``MALLOC_MMAP_THRESHOLD_=65536``, which maps every
   block >= 64 KiB and returns it when freed. Target: FSDP2 <= 0.6x DDP.
2. step time: ampkit O5 on FSDP2 vs a hand-written ``fully_shard`` + ``MixedPrecisionPolicy``
   loop on the same model (a smaller LM, so that many steps fit), both in the same 2
   processes, alternating step by step (which goes first alternates too). Target: median of
   the per-step ratios <= 1.02.

Processes join with gloo on CPU, NCCL on CUDA (one GPU per rank; not run on CPU-only
machines). ``--quick`` shrinks the model to check that everything runs; its figures are not
valid for the targets.
"""
import argparse
import datetime
import gc
import os
import sys
import tempfile
import time
from statistics import median, quantiles

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

import ampkit
from ampkit._cli.demo import MemoryMeter, machine
from ampkit._cli.demo_models import Block, LMConfig, TinyLM, lm_batches, lm_loss

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Log, emulated, finish, table  # noqa: E402  (benchmarks/common.py: the same helpers)

FULL = dict(lm=LMConfig(vocab=256, d_model=1024, n_heads=8, n_layers=4, seq_len=32, batch=2), memory_steps=3,
            speed_lm=LMConfig(vocab=256, d_model=512, n_heads=8, n_layers=4, seq_len=64, batch=4),
            speed_steps=30, warmup=3)
QUICK = dict(lm=LMConfig(vocab=256, d_model=128, n_heads=4, n_layers=2, seq_len=16, batch=2), memory_steps=2,
             speed_lm=LMConfig(vocab=256, d_model=128, n_heads=4, n_layers=2, seq_len=16, batch=2),
             speed_steps=2, warmup=1)
# FULL's shapes where bfloat16 is emulated on this CPU (``--size auto``; there a bf16 matmul runs 3-60x
# slower than fp32): the memory model keeps its >= 50M parameters on 8 tokens a step.
EMULATED = dict(lm=LMConfig(vocab=256, d_model=1024, n_heads=8, n_layers=4, seq_len=8, batch=1), memory_steps=2,
                speed_lm=LMConfig(vocab=256, d_model=64, n_heads=4, n_layers=2, seq_len=32, batch=4), speed_steps=200)
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


def launch(fn, device_type, threads, *args, env=None):
    """``fn(rank, device, *args)`` on 2 fresh processes (with ``env`` added to their environment);
    every rank's return value."""
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_worker, args=(fn, tmp, device_type, threads, args), nprocs=WORLD, join=True)
            return [torch.load(f"{tmp}/{r}.pt", weights_only=False) for r in range(WORLD)]
    finally:
        os.environ.clear()
        os.environ.update(saved)


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


def _say(rank, text):
    """Rank 0's progress line (the ranks write to the parent's stderr)."""
    if rank == 0:
        print(f"    rank 0: {text}", file=sys.stderr, flush=True)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


class LiveBytesMeter:
    """Peak live tensor bytes on CPU from construction on: the running total of the bytes
    allocated and not yet freed, replayed from the allocation and free events that
    ``torch.profiler`` (``profile_memory=True``) records in the CPU allocator, in every thread
    that runs torch ops and collectives (gloo's worker threads included). The CPU counterpart
    of ``torch.cuda.max_memory_allocated``; memory outside torch's allocator (gloo's transport
    buffers, oneDNN scratch, the heap's retention) is not counted.

    Some frees go unrecorded: gloo's worker thread can drop the last reference to a
    collective's input copy after the work's profiled section. Such a block counts as live
    until its address is allocated again, or to the end; read once the run's tensors are
    deleted, ``missed_mib`` sums these blocks. ``peak_mib`` is then an upper bound, at most
    ``missed_mib`` above the true peak.
    """

    def __init__(self):
        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.prof.start()

    def read(self) -> dict:
        self.prof.stop()
        events, allocs = list(self.prof.profiler.kineto_results.experimental_event_tree()), []
        while events:
            e = events.pop()
            events += e.children
            if e.tag == torch._C._profiler._EventType.Allocation:
                allocs.append((e.start_time_ns, e.start_tid, e.extra_fields))
        allocs.sort(key=lambda t_a: t_a[0])
        live, total, peak, missed = {}, 0, 0, 0
        for _, _, a in allocs:
            held = live.pop(a.ptr, 0)
            if a.alloc_size > 0:  # a block still held at this address was freed unrecorded
                missed += held
                live[a.ptr] = a.alloc_size
            total += max(a.alloc_size, 0) - held
            peak = max(peak, total)
        return {"peak_mib": peak / 2**20, "missed_mib": (missed + sum(live.values())) / 2**20,
                "threads": len({tid for _, tid, _ in allocs})}


def meter_check_worker(rank, device):
    """LiveBytesMeter on known patterns: allocate 10 MiB, free, allocate 4 MiB, free (peak
    10 MiB, nothing missed); gloo's all_gather into preallocated outputs, whose flat buffer
    gloo allocates in the calling thread and again in its worker thread."""
    mib = 2**20
    meter = LiveBytesMeter()
    a = torch.empty(10 * mib, dtype=torch.uint8)
    del a
    b = torch.empty(4 * mib, dtype=torch.uint8)
    del b
    pattern = meter.read()
    x, out = torch.ones(4 * mib, dtype=torch.uint8), [torch.empty(4 * mib, dtype=torch.uint8) for _ in range(WORLD)]
    meter = LiveBytesMeter()
    dist.all_gather(out, x)
    return {"pattern": pattern, "gloo_all_gather": meter.read()}


def memory_worker(rank, device, variant, cfg, steps, measure):
    """``{"peak_mib": ...}``, with ``missed_mib`` for the live-bytes meter."""
    meter = LiveBytesMeter() if measure == "live" else MemoryMeter(device)
    model, opt = (_ampkit_fsdp if variant == "fsdp" else _ampkit_ddp)(cfg, device)
    began = time.perf_counter()
    for i, (x, y) in enumerate(lm_batches(cfg, steps, seed=rank)):
        _ampkit_step(model, opt, x.to(device), y.to(device))
        _say(rank, f"{variant} step {i + 1}/{steps} ({time.perf_counter() - began:.1f} s)")
    _sync(device)
    if measure != "live":
        return {"peak_mib": meter.peak_mib()}
    del model, opt, x, y
    gc.collect()  # what reference cycles hold
    _sync(device)
    return meter.read()


def speed_worker(rank, device, cfg, steps, warmup):
    runs = {"ampkit": (*_ampkit_fsdp(cfg, device), _ampkit_step), "hand": (*_hand_fsdp(cfg, device), _hand_step)}
    times, began = {k: [] for k in runs}, time.perf_counter()
    for i, (x, y) in enumerate(lm_batches(cfg, warmup + steps, seed=rank)):
        if (i + 1) % 50 == 0:
            _say(rank, f"step {i + 1}/{warmup + steps} of each loop ({time.perf_counter() - began:.1f} s)")
        x, y = x.to(device), y.to(device)
        for name, (model, opt, step) in (runs.items() if i % 2 == 0 else reversed(runs.items())):
            _sync(device)
            start = time.perf_counter()
            step(model, opt, x, y)
            _sync(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


# name: (meter, environment); the target is checked on the first.
MEASURES = {"cpu": {"live tensor bytes (torch.profiler)": ("live", {}),
                    "RSS rise, glibc default heap": ("rss", {}),
                    "RSS rise, blocks >= 64 KiB mmapped": ("rss", {"MALLOC_MMAP_THRESHOLD_": "65536"})},
            "cuda": {"allocated bytes (torch.cuda.max_memory_allocated)": ("cuda", {})}}


def bench_memory(cfg, device_type, threads, log):
    rows = []
    for measure, (meter, env) in MEASURES[device_type].items():
        row = {"measure": measure}
        for variant in ("ddp", "fsdp"):
            log(f"{variant}, {measure}: 2 fresh processes, {cfg['memory_steps']} steps")
            ranks = launch(memory_worker, device_type, threads, variant, cfg["lm"], cfg["memory_steps"], meter, env=env)
            log(f"{variant}, {measure}: " + " / ".join(f"{r['peak_mib']:.0f}" for r in ranks) + " MiB")
            row[f"{variant}_mib_per_rank"] = [r["peak_mib"] for r in ranks]
            if meter == "live":
                row[f"{variant}_missed_mib_per_rank"] = [r["missed_mib"] for r in ranks]
        row["ratio"] = max(row["fsdp_mib_per_rank"]) / max(row["ddp_mib_per_rank"])
        rows.append(row)
    out = {"lm": str(cfg["lm"]), "params": sum(p.numel() for p in TinyLM(cfg["lm"]).parameters()), "rows": rows,
           "fsdp_vs_ddp": rows[0]["ratio"]}
    if device_type == "cpu":
        log("live-bytes meter check: 2 fresh processes")
        out["meter_check"] = launch(meter_check_worker, device_type, threads)
    return out


def bench_speed(cfg, device_type, threads, log):
    log(f"ampkit and hand-written FSDP2 alternating: 2 fresh processes, {cfg['warmup']} + {cfg['speed_steps']} steps")
    ranks = launch(speed_worker, device_type, threads, cfg["speed_lm"], cfg["speed_steps"], cfg["warmup"])
    t = ranks[0]  # steps end on a barrier: every rank sees the same step times
    ratios = [a / h for a, h in zip(t["ampkit"], t["hand"])]
    return {"lm": str(cfg["speed_lm"]), "params": sum(p.numel() for p in TinyLM(cfg["speed_lm"]).parameters()),
            "ampkit_ms": 1e3 * median(t["ampkit"]), "hand_ms": 1e3 * median(t["hand"]),
            "ratio": median(ratios), "ratio_per_step": ratios, "steps": len(ratios)}


def report(results, quick):
    out = []
    if "memory" in results:
        m = results["memory"]
        out += [f"\n1. Per-rank peak memory, O5, AdamW, 2 ranks (LM {m['params'] / 1e6:.1f}M params, {m['lm']}; "
                f"{m['sizes']} sizes; {m['wall_s']:.0f} s)",
                table(m["rows"], [("measure", "measure", "{}"),
                                  ("DDP MiB (rank 0, 1)", lambda r: " ".join(f"{v:.0f}" for v in r["ddp_mib_per_rank"]), "{}"),
                                  ("FSDP2 MiB (rank 0, 1)", lambda r: " ".join(f"{v:.0f}" for v in r["fsdp_mib_per_rank"]), "{}"),
                                  ("FSDP2 / DDP", "ratio", "{:.2f}x")]),
                "(ratio of the larger rank of each; the target is checked on the first row: live tensors are what "
                "sharding controls, RSS adds what the allocator keeps)"]
        if "meter_check" in m:
            live, c = m["rows"][0], m["meter_check"][0]
            out += [f"live tensor bytes whose free the profiler missed (each peak is at most this much too high): "
                    f"DDP {' '.join(f'{v:.0f}' for v in live['ddp_missed_mib_per_rank'])} MiB, "
                    f"FSDP2 {' '.join(f'{v:.0f}' for v in live['fsdp_missed_mib_per_rank'])} MiB",
                    f"live-bytes check (rank 0): allocate 10 MiB, free, allocate 4 MiB, free -> peak "
                    f"{c['pattern']['peak_mib']:.2f} MiB, missed {c['pattern']['missed_mib']:.2f}; gloo all_gather of "
                    f"2x4 MiB into preallocated outputs -> {c['gloo_all_gather']['peak_mib']:.2f} MiB, allocated in "
                    f"{c['gloo_all_gather']['threads']} threads (gloo's flat buffer, in the calling thread and in its "
                    f"worker thread)"]
    if "speed" in results:
        s = results["speed"]
        out += [f"\n2. Step time on FSDP2, O5, 2 ranks (LM {s['params'] / 1e6:.1f}M params, {s['lm']}; {s['steps']} steps per "
                f"variant, alternating; {s['sizes']} sizes; {s['wall_s']:.0f} s)",
                table([s], [("ampkit ms", "ampkit_ms", "{:.1f}"), ("hand-written ms", "hand_ms", "{:.1f}"),
                            ("median ratio", "ratio", "{:.3f}"),
                            ("quartiles", lambda r: " ".join(f"{q:.3f}" for q in quantiles(r["ratio_per_step"], n=4)), "{}")])]
    out += ["\nTargets" + (" (--quick: sizes too small, not valid for the targets)" if quick else ""),
            table(check_targets(results), [("target", "target", "{}"), ("measured", "measured", "{}"), ("met", "met", "{}")])]
    return "\n".join(out)


def check_targets(results):
    t = []
    if "memory" in results:
        m = results["memory"]
        t.append({"target": "per-rank peak memory (live tensors) FSDP2-O5 <= 0.6x DDP-O5 (>= 50M params)",
                  "measured": f"{m['fsdp_vs_ddp']:.2f}x ({m['params'] / 1e6:.1f}M)",
                  "met": m["fsdp_vs_ddp"] <= 0.6 and m["params"] >= 50e6})
    if "speed" in results:
        s = results["speed"]
        t.append({"target": "step time ampkit FSDP2-O5 / hand-written fully_shard <= 1.02", "measured": f"{s['ratio']:.3f}",
                  "met": s["ratio"] <= 1.02})
    return t


def main(argv=None):
    p = argparse.ArgumentParser(description="ampkit FSDP2 benchmarks (2 ranks)")
    p.add_argument("--quick", action="store_true", help="a small model: a smoke run, not valid for the targets")
    p.add_argument("--json", metavar="PATH", help="write machine, config and results as JSON")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--only", default="memory,speed", help="comma-separated subset of memory,speed")
    p.add_argument("--size", choices=("auto", "full", "small"), default="auto",
                   help="auto: the small shapes where ampkit.capabilities() calls bfloat16 emulated here")
    args = p.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < WORLD:
        p.error(f"--device cuda needs {WORLD} GPUs")
    small = args.size == "small" or (args.size == "auto" and emulated(("O5",), torch.device(args.device)))
    cfg = QUICK if args.quick else {**FULL, **EMULATED} if small else FULL
    info = machine(torch.device(args.device))
    print(f"ampkit {ampkit.__version__} FSDP2 benchmarks{' --quick' if args.quick else ''}: {info}", flush=True)
    started = time.perf_counter()
    benches = {"memory": bench_memory, "speed": bench_speed}
    only = args.only.split(",")
    if set(only) - set(benches):
        p.error(f"--only: choose from {','.join(benches)}")
    results = {}
    for name in (n for n in benches if n in only):
        log = Log(name)
        results[name] = benches[name](cfg, args.device, args.threads, log)
        results[name].update(wall_s=time.perf_counter() - log.start, sizes="quick" if args.quick else "small" if small else "full")
        log(f"done in {results[name]['wall_s']:.0f} s")
    finish(report(results, args.quick), info, args, started, results, check_targets(results))


if __name__ == "__main__":
    main()
