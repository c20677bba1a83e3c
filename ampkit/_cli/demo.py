"""``python -m ampkit demo``: train the built-in models at every opt level, compare in one table.

By default the demo first says how fast this machine computes in half precision
(`ampkit.capabilities`: measured by a short cached probe), then sizes itself to finish within a minute: a quick probe
times three steps per model and compute dtype (fp8 on its own) at a sixteenth of the batch,
under the same load and threads as the runs, and the steps per run (and, on a slower
machine, the batch) are chosen to fit the time that start-up and probe left. ``--steps N``
runs N steps at full size instead.

Each (model, level) run trains in its own fresh process (forked from a server that has
already imported torch), so its peak memory is its own: the resident-set high-water
mark above the process's resident set just before the model was built (on CUDA: the
peak of ``torch.cuda.max_memory_allocated``). Steps/s is the median of steps 2..N (the
first step selects kernels and allocates once); a ratio inside the runs' step-to-step
spread is marked as noise. Every level starts from the same seeded weights and sees the
same batches; a held-out batch of the same data is scored before and after training.
The demo ends with the level it recommends for this machine and why: which half dtype the
device computes faster than float32 (`ampkit.capabilities`) and the precision report of the demo LM.
"""
import dataclasses
import itertools
import json
import logging
import math
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from .._common import text_table
from .._config.levels import OPT_LEVELS, UpdateKind
from .._hardware import SLOWER, capabilities
from .._initialize.initialize import initialize
from .._loop.footprint import bytes_per_param
from .._loop.state import loss_scalers
from .._loop.training import scale_loss
from .._version import __version__
from .demo_models import ConvNet, LMConfig, TinyLM, image_batches, lm_batches, lm_loss
from .progress import Progress

LEVELS = tuple(OPT_LEVELS)
MODELS = ("lm", "cnn")
DEMO_LM = LMConfig(vocab=256, d_model=256, n_heads=4, n_layers=2, seq_len=64, batch=16)
DEMO_CNN = dict(width=16, size=16, batch=32)
SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


# --- isolation: one fresh process per run ----------------------------------------------

def _start_method() -> str:
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


_CTX = multiprocessing.get_context(_start_method())
if _CTX.get_start_method() == "forkserver":
    # torch.optim imports torch._dynamo on first use (seconds): pay that once, in the server.
    _CTX.set_forkserver_preload([__name__, "torch._dynamo"])


def _child(conn, fn, args) -> None:
    try:
        conn.send(("result", fn(*args, report=lambda *msg: conn.send(("progress", msg)))))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def isolated(fn: Callable, *args, report: Optional[Callable] = None):
    """``fn(*args, report=...)`` in a fresh process; its ``report(...)`` calls reach ``report`` here.

    ``fn`` must be importable (module level). Returns what ``fn`` returns; an exception
    in the process is raised here as a RuntimeError carrying the worker's traceback.
    """
    receive, send = _CTX.Pipe(duplex=False)
    proc = _CTX.Process(target=_child, args=(send, fn, args))
    proc.start()
    send.close()
    try:
        while True:
            try:
                kind, value = receive.recv()
            except EOFError:
                proc.join()
                raise RuntimeError(f"{fn.__name__}: worker process died (exit code {proc.exitcode})") from None
            if kind == "progress":
                if report is not None:
                    report(*value)
            elif kind == "result":
                return value
            else:
                raise RuntimeError(f"{fn.__name__} failed in its worker process:\n{value}")
    finally:
        receive.close()
        proc.join()


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark (``getrusage``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class MemoryMeter:
    """Peak memory from construction on: the rise of CUDA's peak allocated, or of the RSS high-water mark."""

    def __init__(self, device: torch.device):
        self.cuda, self.device = device.type == "cuda", device
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
        self.base = torch.cuda.memory_allocated(device) if self.cuda else peak_rss_bytes()

    def peak_mib(self) -> float:
        peak = torch.cuda.max_memory_allocated(self.device) if self.cuda else peak_rss_bytes()
        return (peak - self.base) / 2**20


# --- one training run -------------------------------------------------------------------

def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _batch_size(model_name: str, scale: float) -> int:
    return max(1, round((DEMO_LM.batch if model_name == "lm" else DEMO_CNN["batch"]) * scale))


def _lm_shape(scale: float) -> LMConfig:
    """The LM's batch at ``scale`` times the default tokens: fewer sequences, down to 2, then shorter ones."""
    batch = max(2, round(DEMO_LM.batch * scale))
    seq_len = max(8, min(DEMO_LM.seq_len, round(DEMO_LM.seq_len * DEMO_LM.batch * scale / batch)))
    return dataclasses.replace(DEMO_LM, batch=batch, seq_len=seq_len)


def _batches(model_name: str, scale: float = 1.0):
    """(8 training batches, 1 held-out batch) of the same seeded data."""
    if model_name == "lm":
        batches = lm_batches(_lm_shape(scale), 9)
    else:
        batches = image_batches(9, _batch_size("cnn", scale), DEMO_CNN["size"])
    return batches[:-1], batches[-1]


def heldout_loss(model, loss_fn, batch) -> float:
    """The loss on the held-out batch, without gradients (BatchNorm in train mode uses the batch's
    statistics, as in training; its running statistics are never read in training)."""
    with torch.no_grad():
        return float(loss_fn(model(batch[0]), batch[1]))


def step_spread(seconds: List[float]) -> float:
    """How much the step times vary, relative to their median: the interquartile range (the range
    for fewer than 4 steps), over the median."""
    if len(seconds) < 2:
        return math.inf
    q = statistics.quantiles(seconds, n=4) if len(seconds) >= 4 else [min(seconds), 0, max(seconds)]
    return (q[2] - q[0]) / statistics.median(seconds)


def _size(model_name: str, scale: float) -> str:
    if model_name == "lm":
        shape = _lm_shape(scale)
        return f"{shape.batch}x{shape.seq_len} tokens"
    return f"{_batch_size(model_name, scale)} images"


def _model(model_name: str):
    """(model, SGD optimizer, loss function), seeded: every level starts from the same weights."""
    torch.manual_seed(0)
    if model_name == "lm":
        model, loss_fn, lr = TinyLM(DEMO_LM), lm_loss, 0.3
    else:
        model, loss_fn, lr = ConvNet(DEMO_CNN["width"]), F.cross_entropy, 0.05
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9), loss_fn


def _dtypes(tensors) -> str:
    """Dtypes by share of elements, e.g. ``fp16+fp32`` (BatchNorm kept fp32)."""
    numel: Dict[torch.dtype, int] = {}
    for t in tensors:
        numel[t.dtype] = numel.get(t.dtype, 0) + t.numel()
    return "+".join(SHORT.get(d, str(d)) for d in sorted(numel, key=numel.get, reverse=True))


def _import_torchao() -> None:
    """Import torchao with its import-time log lines held back (a CUDA kernel library it
    cannot load on this machine, a torch deprecation notice): they say nothing about the run."""
    from .._model import float8

    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        float8.require()
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def train(model_name: str, level: str, steps: int, device: str = "cpu", scale: float = 1.0, threads: int = 0,
          report: Optional[Callable] = None) -> dict:
    """Train ``model_name`` at ``level`` for ``steps`` steps on batches ``scale`` times the
    default size (with ``threads`` CPU threads when positive); return one row of the table."""
    if threads > 0:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    train_batches, heldout = _batches(model_name, scale)
    batches = [(x.to(dev), y.to(dev)) for x, y in train_batches]
    heldout = (heldout[0].to(dev), heldout[1].to(dev))
    if getattr(OPT_LEVELS.get(level), "fp8", False):  # an unknown level fails in initialize
        _import_torchao()  # before the meter: torchao's code is not the run's memory
    meter = MemoryMeter(dev)
    model, optimizer, loss_fn = _model(model_name)
    model, optimizer = initialize(model.to(dev), optimizer, opt_level=level, verbosity=0)
    heldout_first = heldout_loss(model, loss_fn, heldout)
    losses, seconds = [], []
    for step, (x, y) in zip(range(steps), itertools.cycle(batches)):
        _sync(dev)
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        with scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        losses.append(loss.detach())
        _sync(dev)
        seconds.append(time.perf_counter() - start)
        if report is not None:
            report(step + 1)
    timed = seconds[1:] or seconds  # the first step selects kernels and allocates once
    scaler = loss_scalers(optimizer)[0]
    props = optimizer._ampkit.run.properties
    losses = torch.stack(losses).float().tolist()
    return {
        "model": model_name,
        "level": level,
        "batch": _size(model_name, scale),
        "weights": _dtypes(model.parameters()),
        "compute": SHORT[props.half_dtype] if props.patch_torch_functions else _dtypes(model.parameters()).split("+")[0],
        "masters": "fp32" if optimizer._ampkit.masters else "-",
        "bytes_per_param": bytes_per_param([model], [optimizer]),
        "steps_per_s": 1 / statistics.median(timed),
        "step_spread": step_spread(timed),
        "peak_mib": meter.peak_mib(),
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "heldout_first": heldout_first,
        "heldout_final": heldout_loss(model, loss_fn, heldout),
        "steps": steps,
        "skipped_steps": scaler.skipped_steps,
        "loss_scale": scaler.loss_scale(),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- the whole demo ---------------------------------------------------------------------

def machine(device: torch.device) -> dict:
    """What the figures were measured on."""
    cpu, flags = platform.processor() or platform.machine(), []
    try:
        with open("/proc/cpuinfo") as f:
            first_cpu = f.read().split("\n\n", 1)[0]
        fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first_cpu.splitlines() if ":" in line)}
        cpu = fields["model name"]
        flags = [x for x in fields["flags"].split() if x.startswith(("amx", "avx512_bf16", "avx512_fp16"))]
    except (OSError, KeyError):
        pass
    info = {
        "cpu": cpu,
        "cpu_flags": " ".join(flags),
        "cores": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "device": str(device),
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def run(levels=LEVELS, steps: int = 30, models=MODELS, device: str = "auto", progress: bool = True,
        scale: float = 1.0, threads: int = 0) -> List[dict]:
    """Train every model at every level, each in a fresh process; return the rows."""
    dev = resolve_device(device)
    bar = Progress(len(levels) * len(models), steps) if progress else None
    rows = []
    for model_name in models:
        for level in levels:
            if bar:
                bar.start(f"{model_name:3} {level}")
            rows.append(isolated(train, model_name, level, steps, str(dev), scale, threads,
                                 report=bar.step if bar else None))
            if bar:
                bar.finish()
    for row in rows:
        base = next((r for r in rows if r["model"] == row["model"] and r["level"] == "O0"), None)
        row["speedup"] = row["steps_per_s"] / base["steps_per_s"] if base else None
        row["noise"] = base is not None and row is not base and within_noise(row, base)
        row["note"] = note(row["level"], dev)
    return rows


def within_noise(row: dict, base: dict) -> bool:
    """Whether ``row``'s speed ratio to ``base`` lies inside the two runs' step-to-step spread."""
    return abs(math.log(row["speedup"])) <= max(row["step_spread"], base["step_spread"])


def note(level: str, device: torch.device) -> str:
    """Why a level's memory and speed look as they do, from its properties."""
    props = OPT_LEVELS[level]
    if props.update is UpdateKind.EIGHT_BIT:
        return "8-bit optimizer state; each step widens it and the weights to fp32: a higher peak here"
    if props.update is UpdateKind.ROUNDED:
        return "no masters; each step updates fp32 copies, rounded back stochastically: a higher peak"
    if props.fp8:
        native = capabilities(device).levels.get(level, "")
        return "O5 + fp8 matmuls" + ("" if "speed" in native else " (emulated on this device: slower)")
    if props.has_masters:
        return "half model + fp32 master weights"
    if props.patch_torch_functions:
        return "autocast: fp32 weights, half matmuls"
    if props.cast_model_type is not None and props.half_dtype is not None:
        return "pure half: no masters, no loss scaling"
    return "the fp32 reference"


# --- sizing the default demo to the machine ---------------------------------------------

BUDGET_S = 30.0  # training time the default demo aims for where start-up and probe are quick
DEADLINE_S = 40.0  # from main() to the table; of 60 s the rest is importing torch (8 s on 2 loaded cores) and slack
RUN_OVERHEAD_S = 0.3  # fork, build and initialize per run, on top of the probed first step
MIN_STEPS, MAX_STEPS = 10, 30
PROBE_SCALE = 1 / 16  # the probe's batch, as a share of the demo's
SCALES = (1.0, 0.5, 0.25, 0.125, 1 / 16, 1 / 32)


def _probe_level(level: str) -> str:
    """The level whose probe stands for ``level``: the one casting the model to the same compute
    dtype; fp8 levels probe themselves (emulated fp8 matmuls cost several bf16 ones)."""
    props = OPT_LEVELS[level]
    if level == "O0" or props.fp8:
        return level
    return "O5" if props.half_dtype == torch.bfloat16 else "O2"


def probe(models, levels, device: str, threads: int = 0, report: Optional[Callable] = None) -> Dict[str, List[float]]:
    """In one process: ``"model level" -> [first step s, later step s]`` for each model and each
    probe level of ``levels``, 3 steps at ``PROBE_SCALE`` of the batch. The first step's time
    includes building and initializing the model; a later step's is the slower of the two."""
    out = {}
    for model_name in models:
        for level in sorted({_probe_level(lvl) for lvl in levels}):
            stamps, start = [], time.perf_counter()
            train(model_name, level, 3, device, PROBE_SCALE, threads,
                  report=lambda done: stamps.append(time.perf_counter()))
            out[f"{model_name} {level}"] = [stamps[0] - start, max(b - a for a, b in zip(stamps, stamps[1:]))]
    return out


def run_budget(elapsed: float) -> float:
    """Training seconds for `plan` when start-up and probe took ``elapsed`` seconds."""
    return min(BUDGET_S, DEADLINE_S - elapsed)


def plan(times: Dict[str, List[float]], models, levels, budget: float = BUDGET_S):
    """(steps, batch scale): the most steps (at most ``MAX_STEPS``) at the largest batch that fit
    ``budget`` with at least ``MIN_STEPS``; else what fits (at least 3 steps) at the smallest batch."""
    runs = [times[f"{m} {_probe_level(lvl)}"] for m in models for lvl in levels]
    steps = MIN_STEPS
    for scale in SCALES:
        k = scale / PROBE_SCALE  # step time grows at most linearly with the batch
        fixed = sum(RUN_OVERHEAD_S + first * max(k, 1.0) for first, _ in runs)  # building does not shrink
        per_step = sum(step * k for _, step in runs)
        steps = 1 + int((budget - fixed) / per_step) if budget > fixed else 0
        if steps >= MIN_STEPS:
            return min(steps, MAX_STEPS), scale
    return max(3, steps), SCALES[-1]


def describe(caps) -> List[str]:
    """What half precision buys on this device, in plain words (from ``caps``: measured, or the flags)."""
    by_gain: Dict[str, List[str]] = {}
    for level, gain in caps.levels.items():
        if level != "O0":
            by_gain.setdefault(gain, []).append(level)
    lines = [f"This machine: {caps.line()}"]
    lines += [f"  {'/'.join(lvls)}: {gain}" for gain, lvls in by_gain.items()]
    bf16, fp16 = caps.fast(torch.bfloat16), caps.fast(torch.float16)
    if not (bf16 or fp16):
        lines.append("  No half dtype is faster than float32 here: half precision only saves memory, and half levels "
                     "are expected to run no faster than O0, slower where marked (the tiny demo runs are dominated "
                     "by fixed costs).")
    elif not fp16:
        lines.append("  float16 is not faster than float32 here: O1/O2/O3 only save memory; bfloat16 (O4/O5/O7/O8) is "
                     "the fast path.")
    elif not bf16:
        lines.append("  bfloat16 is not faster than float32 here: O4/O5/O7/O8 only save memory; float16 (O1/O2) is "
                     "the fast path.")
    return lines


COLUMNS = [
    ("model", "model", "{}"), ("level", "level", "{}"), ("weights", "weights", "{}"),
    ("compute", "compute", "{}"), ("masters", "masters", "{}"),
    ("bytes/param", "bytes_per_param", "{:.1f}"), ("steps/s", "steps_per_s", "{:.1f}"),
    ("vs O0", "speedup", "{:.2f}x"), ("peak MiB", "peak_mib", "{:.0f}"),
    ("held-out loss", "heldout_first", "{:.3f}"), ("skipped", "skipped_steps", "{}"), ("loss scale", "loss_scale", "{:g}"),
    ("note", "note", "{}"),
]


def _cell(row: dict, key: str, fmt: str) -> str:
    if row.get(key) is None:
        return "-"
    if key == "heldout_first":  # before -> after training
        return f"{row['heldout_first']:.3f} -> {row['heldout_final']:.3f}"
    text = fmt.format(row[key])
    return "~" + text if key == "speedup" and row.get("noise") else text


def format_table(rows: List[dict]) -> str:
    head = [c[0] for c in COLUMNS]
    body = [[_cell(r, key, fmt) for _, key, fmt in COLUMNS] for r in rows]
    return text_table.format_table(head, body, left=len(head))


def _installed(levels):
    """``levels`` without the fp8 ones when torchao (the ``ampkit[fp8]`` extra) is missing, saying so."""
    from .._model import float8

    missing = [lvl for lvl in levels if OPT_LEVELS[lvl].fp8 and not float8.available()]
    if missing:
        print(f"left out {', '.join(missing)}: fp8 needs torchao ({install_hint(float8.EXTRA)})", flush=True)
    return [lvl for lvl in levels if lvl not in missing]


def install_hint(extra: str) -> str:
    """The pip command for ``extra`` (``"ampkit[fp8]"``): ``-e ".[fp8]"`` where ampkit runs from a checkout."""
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / "ampkit" / "__init__.py").is_file():
        return f'from this checkout: pip install -e ".[{extra.split("[", 1)[1]}"'
    return f"pip install '{extra}'"


def advice(device: str = "cpu", report: Optional[Callable] = None) -> dict:
    """The precision report of the demo LM (measured on the CPU, in a worker): its speed and memory
    recommendations for ``device``'s capabilities. ``report`` is the worker's progress hook (unused)."""
    from .report import demo_report

    found, caps = demo_report("lm"), capabilities(device)
    speed, memory = found.recommend(capabilities=caps), found.recommend("memory", capabilities=caps)
    return {"level": speed.level, "reason": speed.reason, "memory_level": memory.level, "memory_reason": memory.reason,
            "memory_slower": caps.levels.get(memory.level) == SLOWER}


def caveats(rows: List[dict], info: dict, device: torch.device) -> List[str]:
    """What the table can be trusted for on this machine, in plain words: speed noise, a busy machine, a
    held-out loss that did not fall."""
    spread = max((r["step_spread"] for r in rows), default=0.0)
    lines = []
    if any(r["noise"] for r in rows):
        lines.append(f"~: the ratio is inside the step-to-step spread of the two runs (up to {min(spread, 9.99):.0%} "
                     f"of a step here): too close to call on this machine.")
    load = info.get("load_average")
    if device.type == "cpu" and load is not None and load >= info["cores"]:
        lines.append(f"The machine was busy (load average {load:.1f} on {info['cores']} cores): the speed column is "
                     f"noise-level here, and a second run may rank the levels differently.")
    stalled = sorted({r["model"] for r in rows if r["heldout_final"] >= r["heldout_first"]})
    if stalled:
        lines.append(f"The held-out loss of {' and '.join(stalled)} did not fall in {rows[0]['steps']} steps at this batch: "
                     f"too few to learn from; --steps 30 trains long enough (it takes longer).")
    return lines


def recommendation(rows: List[dict], found: dict) -> List[str]:
    """The closing lines: one level for this machine, why, and what this run measured of it."""
    level = found["level"]
    lines = [f"Recommended here: {level}. {found['reason']}"]
    for row in (r for r in rows if r["level"] == level and r["speedup"] is not None and level != "O0"):
        speed = "within the noise of" if row["noise"] else ("faster than" if row["speedup"] > 1 else "slower than")
        lines.append(f"  Measured in this run ({row['model']}): {row['speedup']:.2f}x O0's steps/s ({speed} O0), "
                     f"{row['bytes_per_param']:.1f} bytes/param.")
    memory = found["memory_level"]
    kept = {r["level"]: r["bytes_per_param"] for r in rows if r["model"] == rows[0]["model"]}
    least = min(kept, key=kept.get) if kept else None
    if least and least != level:
        lines.append(f"  For the least memory: {least} keeps {kept[least]:.1f} bytes/param here "
                     f"(the precision report judges O1-O7; its memory pick is {memory}).")
    if memory != level and found.get("memory_slower"):
        lines.append(f"  {memory} runs slower than O0 on this machine: pick it for the memory, not for speed.")
    return lines


def main(levels=LEVELS, steps: Optional[int] = None, models=MODELS, device: str = "auto",
         json_path: Optional[str] = None) -> List[dict]:
    """Run the demo, print the table (and write ``json_path``); return the rows.

    ``steps=None`` sizes the demo to the machine (see `plan`); a number runs that many
    steps at the full batch.
    """
    started = time.perf_counter()
    dev = resolve_device(device)
    info = machine(dev)
    levels = _installed(levels)
    caps = capabilities(dev)
    print(f"ampkit {__version__} demo on {info['device']} ({info['cpu']}, {info['threads']} threads, "
          f"torch {info['torch']})", flush=True)
    print("\n".join(describe(caps)), flush=True)
    scale, times, threads = 1.0, None, 0
    found = isolated(advice, str(dev))  # before the probe, so its seconds come out of the training budget
    if steps is None:
        load = info["load_average"]
        if dev.type == "cpu" and load is not None and info["threads"] > 1 and load >= info["cores"]:
            # Threads of one op wait for each other; on a busy machine each wait can cost a time slice.
            threads = 1
            print(f"The machine is busy (load average {load:.1f} on {info['cores']} cores): one thread per run.")
        probed = time.perf_counter()
        times = isolated(probe, tuple(models), tuple(levels), str(dev), threads)
        steps, scale = plan(times, models, levels, run_budget(time.perf_counter() - started))
        sizes = ", ".join(f"{m} {_size(m, scale)}" for m in models)
        print(f"Speed probe ({time.perf_counter() - probed:.1f} s): {steps} steps per run, {sizes}, to finish within "
              f"a minute (--steps N: N steps at the full batch).", flush=True)
    rows = run(levels, steps, models, str(dev), scale=scale, threads=threads)
    memory = "peak CUDA memory allocated" if dev.type == "cuda" else "peak RSS of the run's own process above its RSS before the model was built"
    print()
    print(format_table(rows))
    print(f"\nsteps/s: the median of steps 2..{steps} (the first step is warm-up); peak MiB: {memory}; bytes/param: "
          f"weights, master weights and optimizer state (SGD momentum) after the run, measured from their storages; "
          f"held-out loss: a batch the run never trains on, before -> after training.")
    print("\n".join(caveats(rows, info, dev)))
    print()
    print("\n".join(recommendation(rows, found)), flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"machine": info, "capabilities": dataclasses.asdict(caps), "steps": steps, "batch_scale": scale,
                       "threads_per_run": threads or info["threads"], "probe": times, "recommendation": found,
                       "rows": rows}, f, indent=2)
        print(f"wrote {json_path}")
    return rows
