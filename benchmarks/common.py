"""Helpers every benchmark family shares: sizes, timing, threads, progress lines, tables, the
copy bandwidth, the report's epilogue (``benchmarks/run.py`` dispatches; each family is a
module of ``benchmarks/families/``)."""
import contextlib
import json
import os
import sys
import time
from statistics import median

import torch

import ampkit
from ampkit._cli.demo_models import LMConfig
from ampkit._common.text_table import format_table

HALF = {"O1": torch.float16, "O2": torch.float16, "O3": torch.float16, "O4": torch.bfloat16, "O5": torch.bfloat16}
LR = 0.01

FULL = dict(
    overhead_lm=LMConfig(vocab=256, d_model=256, n_heads=4, n_layers=2, seq_len=64, batch=16),
    overhead_steps=60, repeats=3, warmup=3,
    speed_lm=LMConfig(vocab=256, d_model=512, n_heads=8, n_layers=4, seq_len=128, batch=16),
    speed_cnn=dict(width=32, size=32, batch=64), speed_steps=10,
    unscale_elements=64 * 2**20, unscale_iters=10, sync_blocks=(1, 16, 256),
    memory_lm=LMConfig(vocab=256, d_model=256, n_heads=8, n_layers=4, seq_len=256, batch=32), memory_steps=3,
    scaling_d=(256, 512, 1024), scaling_seq=128, scaling_batch=4, scaling_steps=8,
    compile_lm=LMConfig(vocab=256, d_model=256, n_heads=4, n_layers=2, seq_len=64, batch=16), compile_steps=20,
    compile_big=("O0", "O5"),
    update_params=1 << 24, update_steps=10,
    # sized to about 50 minutes on a quiet 2-core CPU with --jobs 2 --threads 1 (docs/benchmarks/convergence.md):
    # 4 epochs of Fashion-MNIST's 60,000 images at batch 128 (468 steps an epoch) for both image tasks
    convergence=dict(seeds=4, curve_points=8, tasks=dict(
        cnn=dict(steps=4 * 468, batch=128, lr=3e-3),
        mlp=dict(steps=4 * 468, batch=128, lr=2e-3, seeds=5),  # its control's gap is small next to the seeds' spread
        gpt=dict(steps=300, lr=3e-3, windows=128,
                 lm=LMConfig(vocab=256, d_model=64, n_heads=4, n_layers=2, seq_len=64, batch=16)))),
)
QUICK = dict(  # small enough for emulated half precision too; no transformer rows in the compile family
    overhead_lm=LMConfig(vocab=256, d_model=64, n_heads=4, n_layers=2, seq_len=32, batch=4),
    overhead_steps=8, repeats=1, warmup=2,
    speed_lm=LMConfig(vocab=256, d_model=64, n_heads=4, n_layers=2, seq_len=32, batch=4),
    speed_cnn=dict(width=8, size=16, batch=16), speed_steps=3,
    unscale_elements=8 * 2**20, unscale_iters=3, sync_blocks=(1, 16),
    memory_lm=LMConfig(vocab=256, d_model=64, n_heads=4, n_layers=2, seq_len=64, batch=4), memory_steps=2,
    scaling_d=(32, 64, 128), scaling_seq=32, scaling_batch=2, scaling_steps=3,
    compile_lm=LMConfig(vocab=64, d_model=32, n_heads=2, n_layers=1, seq_len=16, batch=4), compile_steps=3,
    compile_big=(),
    update_params=1 << 20, update_steps=4,
    convergence=dict(seeds=2, curve_points=2, tasks=dict(
        cnn=dict(steps=16, batch=32, lr=3e-3, limit=2000),
        mlp=dict(steps=30, batch=64, lr=1e-3, limit=2000),
        gpt=dict(steps=16, lr=3e-3, windows=16,
                 lm=LMConfig(vocab=256, d_model=32, n_heads=2, n_layers=1, seq_len=32, batch=8)))),
)
# FULL's shapes for a family whose half dtype this CPU emulates (``--size auto``): there a bf16 or
# fp16 matmul runs 3-60x slower than in fp32, and FULL would take an hour per family.
EMULATED = dict(
    overhead_lm=LMConfig(vocab=256, d_model=64, n_heads=4, n_layers=2, seq_len=32, batch=8),
    speed_lm=LMConfig(vocab=256, d_model=128, n_heads=8, n_layers=4, seq_len=64, batch=4),
    speed_cnn=dict(width=16, size=16, batch=32),
    memory_lm=LMConfig(vocab=256, d_model=128, n_heads=4, n_layers=4, seq_len=256, batch=8), memory_steps=2,
    scaling_d=(64, 128, 256), scaling_seq=64, scaling_steps=5,
)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step, device, *args) -> float:
    _sync(device)
    start = time.perf_counter()
    step(*args)
    _sync(device)
    return time.perf_counter() - start


def params_of(model) -> int:
    return sum(p.numel() for p in model.parameters())


def emulated(levels, device) -> bool:
    """Whether any of ``levels`` computes in a half dtype that ``ampkit.capabilities`` calls emulated on this CPU."""
    gains = ampkit.capabilities(device).levels
    return device.type == "cpu" and any(gains[lvl] not in ("speed and memory", "baseline") for lvl in levels)


def sized(cfg, levels, device, size) -> dict:
    """FULL with EMULATED's shapes where ``size`` is small, or auto and one of ``levels`` is emulated here."""
    if cfg is QUICK:
        return {**cfg, "sizes": "quick"}
    small = size == "small" or (size == "auto" and emulated(levels, device))
    return {**cfg, **EMULATED, "sizes": "small"} if small else {**cfg, "sizes": "full"}


@contextlib.contextmanager
def env_restored(name: str):
    """Put environment variable ``name`` back as found when the block ends (families set ``AMPKIT_FUSED`` per step)."""
    saved = os.environ.get(name)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def default_threads() -> int:
    """torch's threads, less one per busy core (1-minute load average): a descheduled thread stalls every op."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return max(1, min(torch.get_num_threads(), round((os.cpu_count() or 1) - load)))


class Log:
    """Progress lines on stderr, flushed at once: ``[overhead   12.3 s] O1 model: repeat 1/3 ...``."""

    def __init__(self, family: str):
        self.family, self.start = family, time.perf_counter()

    def __call__(self, *parts) -> None:
        elapsed = time.perf_counter() - self.start
        print(f"  [{self.family} {elapsed:6.1f} s] " + " ".join(map(str, parts)), file=sys.stderr, flush=True)


def lm_shape(spec: LMConfig) -> str:
    return f"d{spec.d_model} x{spec.n_layers} {spec.batch}x{spec.seq_len} tok"


def stream_gbps(device, mib=256, repeats=5) -> float:
    """Bytes read plus bytes written per second by ``copy_`` between two ``mib``-MiB float32
    tensors (median of ``repeats``): what a step that streams through memory can reach."""
    src = torch.ones(mib << 18, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * src.nbytes / median(timed(dst.copy_, device, src) for _ in range(repeats)) / 1e9


def adamw_floor_bytes(model, level) -> int:
    """The fewest bytes one AdamW step at ``level`` moves: per parameter, its gradient read, its
    weight (the fp32 master where there is one) read and written, its two fp32 state tensors
    read and written, and with masters the model's copy written."""
    masters = ampkit.OPT_LEVELS[level].master_weights
    total = 0
    for p in model.parameters():
        size = p.element_size()
        total += p.numel() * (size + (8 + size if masters else 2 * size) + 16)
    return total


def table(rows, columns):
    """``columns``: (header, key or function, format)."""
    def cell(r, key, fmt):
        v = key(r) if callable(key) else r.get(key)
        return "-" if v is None else fmt.format(v)
    head = [c[0] for c in columns]
    body = [[cell(r, k, f) for _, k, f in columns] for r in rows]
    return format_table(head, body)


def finish(text: str, info: dict, args, started: float, results: dict, targets) -> None:
    """Print a benchmark's report and the load average around it; write the JSON if ``--json``."""
    print(text)
    print(f"\nload average (1 min): {info['load_average']:.2f} at the start, {os.getloadavg()[0]:.2f} at the end, "
          f"on {info['cores']} cores; more than the core count means other work shared the CPUs.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "load_average_end": os.getloadavg()[0], "argv": sys.argv, "quick": args.quick,
                       "seconds": time.perf_counter() - started,
                       "results": results, "targets": targets}, f, indent=2)
        print(f"\nwrote {args.json}")
