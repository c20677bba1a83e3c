"""ampkit benchmarks: six families measured side by side in one run, tables to stdout, JSON to a file.

    python benchmarks/run.py [--quick] [--json PATH] [--only overhead,speedup,unscale,memory,scaling,compile]
                             [--compile-levels native|all|O0,O5] [--device cpu|cuda] [--threads N] [--size auto|full|small]

1. overhead: ampkit O1/O4 vs a hand-written torch.autocast + torch.amp.GradScaler loop, and
   O2/O5 vs a hand-written half model + fp32 master loop; per level one fresh process in
   which the two variants alternate step by step, 3 repeats of 60 steps. The ratio is the median
   of the per-step ratios (each ampkit step over the hand-written step next to it, so a load that
   comes and goes hits both). Target: ratio <= 1.02.
2. speedup: steps/s of O0, O4, O5 on the transformer (d_model 512) and the CNN, each
   repeat of each level in a fresh process, levels interleaved. Target: O5 >= 2.5x O0 (LM).
3. unscale: ampkit's unscale + overflow check over >= 50M gradient elements (fp32 grads,
   and half grads into fp32 masters) vs a torch copy of the same bytes (and, for half grads,
   vs the bare half -> fp32 conversion copy), and host syncs per
   step counted at the dispatcher. Targets: >= 0.5 of copy bandwidth; exactly 1 sync.
4. memory: peak RSS per level on the transformer with an activation-heavy batch, one fresh
   process per level. Target: O3 and O5 <= 0.6x O0.
5. scaling: step time and peak memory of O0 and O5 at x1, x4, x16 parameters.
6. compile: per level, eager ampkit vs compiled ampkit (the README pattern: compiled model,
   eager scale_loss, compiled optimizer step) vs the hand-written loop compiled the same way,
   AdamW, one fresh process per level, the three alternating step by step; then eager vs
   compiled at O0/O5 on the speed-up family's transformer (where O5 is among the levels). O6/O7 have no hand-written loop, and
   at O7 only the model is compiled (the README's pattern there). Targets: compiled ampkit <= 1.02x
   compiled hand-written; O5 compiled >= 1.3x O5 eager (transformer, native-bf16 CPU). On a
   CPU each row also profiles 3 eager and 3 compiled steps, alternating (self CPU time in matmul
   kernels and in all other ops): the matmuls' share s of the eager step bounds what compiling,
   which leaves the matmuls to the same oneDNN kernels, can gain: at most 1/s. A tighter bound
   adds the optimizer's memory floor: AdamW must read and write every weight (or master) and
   its two fp32 state tensors, read every gradient, and at O2/O5 write the model's half copy
   (28 bytes per parameter at O0 and O5), which takes at least those bytes over the bandwidth
   of a large same-dtype copy measured in the same process.

Every family prints progress lines to stderr as it goes (per level, worker and repeat, with the
seconds since the family started) and its wall time in its table and the JSON (``wall_s``).
``--size auto`` (the default) uses the EMULATED shapes for a family whose half dtype
``ampkit.capabilities()`` calls emulated on this CPU (on AVX2 a bf16 or fp16 matmul runs about 60x
slower than fp32, and the full shapes took an hour per family); ``full`` and ``small`` force one.
``--threads`` defaults to torch's threads less one per busy core (1-minute load average): on a
shared machine a second thread waits for its descheduled partner in every op.
``--quick`` shrinks sizes and repeats to check that everything runs (well under a minute); its
figures are not valid for the targets. Nothing here runs in the unit tests.
``benchmarks/plot.py`` draws speed-up and memory per level from the JSON.
"""
import argparse
import json
import math
import os
import sys
import time
from functools import partial
from statistics import median

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ampkit
from ampkit.apps.demo import MemoryMeter, isolated, machine, peak_rss_bytes
from ampkit.apps.demo_models import ConvNet, LMConfig, TinyLM, image_batches, lm_batches, lm_loss
from ampkit.core.text_table import format_table

HALF = {"O1": torch.float16, "O2": torch.float16, "O3": torch.float16, "O4": torch.bfloat16, "O5": torch.bfloat16}
FAMILIES = ("overhead", "speedup", "unscale", "memory", "scaling", "compile")
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


# --- the training steps: ampkit and hand-written ---------------------------------------

def make_optimizer(params, kind="sgd"):
    """SGD with momentum (the default everywhere) or AdamW (the compile family)."""
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=LR / 10, eps=1e-4)  # 1e-8 rounds to 0 in fp16 (O3 steps on fp16)
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


class AmpkitLoop:
    """The README loop."""

    def __init__(self, model, level, loss_fn, opt_kind="sgd"):
        opt = make_optimizer(model.parameters(), opt_kind)
        self.model, self.opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0)
        self.loss_fn = loss_fn

    def step(self, x, y):
        self.opt.zero_grad()
        loss = self.loss_fn(self.model(x), y)
        with ampkit.scale_loss(loss, self.opt) as scaled:
            scaled.backward()
        self.opt.step()

    def skipped(self) -> int:
        return ampkit.loss_scalers(self.opt)[0].skipped_steps


class AutocastLoop:
    """Hand-written O1/O4: torch.autocast + torch.amp.GradScaler (init scale 2**16 or 1.0)."""

    def __init__(self, model, dtype, init_scale, loss_fn, device, opt_kind="sgd"):
        self.model, self.dtype, self.loss_fn, self.device = model, dtype, loss_fn, device
        self.opt = make_optimizer(model.parameters(), opt_kind)
        self.init_scale = init_scale
        self.scaler = torch.amp.GradScaler(device.type, init_scale=init_scale)

    def step(self, x, y):
        self.opt.zero_grad()
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            out = self.model(x)
        loss = self.loss_fn(out.float(), y)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()

    def skipped(self) -> int:
        # Every skip halves the scale, and no run here reaches growth_interval=2000 clean steps.
        return round(math.log2(self.init_scale / self.scaler.get_scale()))


class MasterLoop:
    """Hand-written O2/O5: half model (BatchNorm fp32), fp32 master copy, one fused check per step.

    Same arithmetic as ampkit: loss times the scale, half grads to fp32, fused unscale +
    inf/NaN check, one host read of the flag, skip and back off on overflow (dynamic).
    """

    def __init__(self, model, dtype, scale, dynamic, loss_fn, opt_kind="sgd", masters=True):
        for m in model.modules():
            if not isinstance(m, nn.modules.batchnorm._BatchNorm):
                for p in m.parameters(recurse=False):
                    p.data = p.data.to(dtype)
        self.model, self.dtype, self.loss_fn = model, dtype, loss_fn
        self.half = [p for p in model.parameters() if p.dtype == dtype]
        self.plain = [p for p in model.parameters() if p.dtype != dtype]
        self.use_masters = masters
        self.masters = [p.detach().float().requires_grad_() for p in self.half] if masters else self.half
        self.opt = make_optimizer(self.masters + self.plain, opt_kind)
        self.scale, self.dynamic, self.skips = scale, dynamic, 0
        self.found = torch.zeros(1, device=self.masters[0].device)

    def step(self, x, y):
        for p in self.model.parameters():
            p.grad = None
        x = x.to(self.dtype) if x.is_floating_point() else x
        loss = self.loss_fn(self.model(x).float(), y)
        (loss * self.scale if self.scale != 1.0 else loss).backward()
        grads = [p.grad.float() for p in self.half] if self.use_masters else [p.grad for p in self.half]
        self.found.zero_()
        inv = torch.full((), 1.0 / self.scale, device=self.found.device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads + [p.grad for p in self.plain], self.found, inv)
        if self.found.item():
            self.skips += 1
            if self.dynamic:
                self.scale /= 2
            return
        for m, g in zip(self.masters, grads):
            m.grad = g
        self.update()

    def update(self):
        self.opt.step()
        if self.use_masters:
            with torch.no_grad():
                torch._foreach_copy_(self.half, self.masters)

    def skipped(self) -> int:
        return self.skips


def hand_loop(level, model, loss_fn, device, opt_kind="sgd"):
    if level == "O0":  # fp32, GradScaler at scale 1.0: the same inf/NaN check and skip as ampkit's O0
        return AutocastLoop(model, None, 1.0, loss_fn, device, opt_kind)
    if level in ("O1", "O4"):
        return AutocastLoop(model, HALF[level], 2.0**16 if level == "O1" else 1.0, loss_fn, device, opt_kind)
    if level == "O3":  # pure half, no masters: the optimizer steps on the half weights
        return MasterLoop(model, HALF[level], 1.0, False, loss_fn, opt_kind, masters=False)
    return MasterLoop(model, HALF[level], 2.0**16 if level == "O2" else 1.0, level == "O2", loss_fn, opt_kind)


# --- compiled loops (the README's pattern): compiled model, eager loss scaling, compiled step ---

class CompiledAmpkitLoop(AmpkitLoop):
    def __init__(self, model, level, loss_fn, opt_kind="adamw"):
        super().__init__(model, level, loss_fn, opt_kind)
        self.forward = torch.compile(self.model, fullgraph=True)
        opt = self.opt
        if ampkit.OPT_LEVELS[level].update_rounding:  # O7: the README compiles only the model
            self.update = opt.step
            return

        @torch.compile
        def update():
            opt.step()

        self.update = update

    def step(self, x, y):
        self.opt.zero_grad()
        loss = self.loss_fn(self.forward(x), y)
        with ampkit.scale_loss(loss, self.opt) as scaled:
            scaled.backward()
        self.update()


def compiled_hand_loop(level, model, loss_fn, device, opt_kind="adamw"):
    """The hand-written loop of ``level`` with its model and its optimizer update compiled the same way."""
    loop = hand_loop(level, model, loss_fn, device, opt_kind)
    loop.model = torch.compile(loop.model, fullgraph=True)
    if isinstance(loop, AutocastLoop):
        loop.opt.step = torch.compile(loop.opt.step)  # GradScaler.step calls it when the grads are finite
    else:
        loop.update = torch.compile(loop.update)
    return loop


# --- 1. front-end overhead ------------------------------------------------------------

def alternate(amp, hand, batches, device, repeats, warmup, steps, say):
    """Per-step times of both loops, alternating step by step (the order flips every step and
    repeat), and per repeat the median of the per-step ratios ampkit / hand; ``say(text)`` after each repeat."""
    times, per_repeat = {"ampkit": [], "hand": []}, []
    for r in range(repeats):
        start = time.perf_counter()
        for i in range(warmup):
            amp.step(*batches[i % len(batches)])
            hand.step(*batches[i % len(batches)])
        rep = {"ampkit": [], "hand": []}
        for i in range(steps):
            order = (("ampkit", amp), ("hand", hand)) if (i + r) % 2 == 0 else (("hand", hand), ("ampkit", amp))
            for name, loop in order:
                rep[name].append(timed(loop.step, device, *batches[i % len(batches)]))
        per_repeat.append(median(a / h for a, h in zip(rep["ampkit"], rep["hand"])))
        for k in times:
            times[k] += rep[k]
        say(f"repeat {r + 1}/{repeats}: {steps} steps each, {1e3 * median(rep['hand']):.1f} ms/step, "
            f"ratio {per_repeat[-1]:.3f} ({time.perf_counter() - start:.1f} s)")
    return times, per_repeat


def overhead_worker(level, lm, steps, repeats, warmup, device, threads, report):
    """In a fresh process: ampkit and the hand-written loop at ``level``, alternating step by
    step, on the model and on a tiny model of the same structure (ampkit's fixed cost)."""
    torch.set_num_threads(threads)
    device = torch.device(device)
    # The same layer structure (30 parameter tensors) with almost no arithmetic.
    tiny = LMConfig(vocab=32, d_model=16, n_heads=2, n_layers=lm.n_layers, seq_len=8, batch=2)
    found = {}
    for name, spec, n in (("model", lm, steps), ("tiny", tiny, 100)):
        batches = [(x.to(device), y.to(device)) for x, y in lm_batches(spec, 4)]
        torch.manual_seed(0)
        amp = AmpkitLoop(TinyLM(spec).to(device), level, lm_loss)
        torch.manual_seed(0)
        hand = hand_loop(level, TinyLM(spec).to(device), lm_loss, device)
        say = partial(report, f"{level} {name}:")
        found[name] = alternate(amp, hand, batches, device, repeats, warmup, n, say) + (amp, hand)
    (times, per_repeat, amp, hand), (tiny_times, _, _, _) = found["model"], found["tiny"]
    return {
        "level": level, "lm": lm_shape(lm),
        "baseline": "autocast + GradScaler" if level in ("O1", "O4") else "half model + fp32 masters",
        "ampkit_ms": 1e3 * median(times["ampkit"]), "hand_ms": 1e3 * median(times["hand"]),
        # The two steps of a pair run back to back, so a load that comes and goes hits both alike.
        "ratio": median(a / h for a, h in zip(times["ampkit"], times["hand"])),
        "ratio_per_repeat": per_repeat, "steps_per_variant": len(times["ampkit"]),
        "fixed_extra_ms": 1e3 * (median(tiny_times["ampkit"]) - median(tiny_times["hand"])),
        "skipped": {"ampkit": amp.skipped(), "hand": hand.skipped()},
    }


def bench_overhead(cfg, device, threads, size, log):
    rows, sizes = [], set()
    for level in ("O1", "O4", "O2", "O5"):
        level_cfg = sized(cfg, (level,), device, size)
        lm = level_cfg["overhead_lm"]
        sizes.add(level_cfg["sizes"])
        log(f"{level}: fresh process, LM {lm_shape(lm)}, {cfg['repeats']} repeats of {cfg['warmup']} warm-up + "
            f"{cfg['overhead_steps']} steps per loop, then the tiny LM")
        rows.append(isolated(overhead_worker, level, lm, cfg["overhead_steps"], cfg["repeats"], cfg["warmup"],
                             str(device), threads, report=log))
    return {"model": "TinyLM, 2 layers, vocab 256 (per level: LM column)", "rows": rows, "sizes": ",".join(sorted(sizes))}


# --- 2. speed-up, 4. memory, 5. scaling: one fresh process per run ---------------------

def train_worker(kind, spec, level, steps, warmup, device, threads, report):
    """In a fresh process: train ``steps`` timed steps after ``warmup``; times and peak memory.
    A step over 5 s (a slow machine) is reported as it ends."""
    torch.set_num_threads(threads)
    device = torch.device(device)
    batches = lm_batches(spec, 2) if kind == "lm" else image_batches(2, spec["batch"], spec["size"])
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    meter = MemoryMeter(device)  # counts the model, its gradients, optimizer state, activations
    torch.manual_seed(0)
    model, loss_fn = (TinyLM(spec), lm_loss) if kind == "lm" else (ConvNet(spec["width"]), F.cross_entropy)
    n_params = params_of(model)
    loop = AmpkitLoop(model.to(device), level, loss_fn)
    times = []
    for i in range(warmup + steps):
        times.append(timed(loop.step, device, *batches[i % 2]))
        if times[-1] > 5:
            report(f"{kind} {level}: step {i + 1}/{warmup + steps} took {times[-1]:.1f} s")
    return {"step_s": times[warmup:], "peak_mib": meter.peak_mib(), "rss_mib": peak_rss_bytes() / 2**20,
            "params": n_params, "skipped": loop.skipped()}


def interleaved(runs, repeats, log):
    """Run each ``(key, args)`` in a fresh process, ``repeats`` times, the order rotated per repeat."""
    results = {key: [] for key, _ in runs}
    for r in range(repeats):
        for key, args in runs[r % len(runs):] + runs[: r % len(runs)]:
            res = isolated(train_worker, *args, report=log)
            kind, spec, level = args[:3]
            log(f"{kind} {level} ({lm_shape(spec) if kind == 'lm' else spec}): repeat {r + 1}/{repeats}, "
                f"{1e3 * median(res['step_s']):.1f} ms/step, peak {res['peak_mib']:.0f} MiB")
            results[key].append(res)
    return results


def _merge(results):
    times = [t for res in results for t in res["step_s"]]
    return {"step_ms": 1e3 * median(times), "steps_per_s": 1 / median(times), "samples": len(times),
            "peak_mib": max(res["peak_mib"] for res in results), "rss_mib": max(res["rss_mib"] for res in results),
            "params": results[0]["params"],
            "skipped": max(res["skipped"] for res in results)}


def bench_speedup(cfg, device, threads, log):
    out = []
    for kind, spec in (("lm", cfg["speed_lm"]), ("cnn", cfg["speed_cnn"])):
        runs = [(lvl, (kind, spec, lvl, cfg["speed_steps"], 2, str(device), threads)) for lvl in ("O0", "O4", "O5")]
        merged = {lvl: _merge(res) for lvl, res in interleaved(runs, cfg["repeats"], log).items()}
        for lvl, row in merged.items():
            row.update(model=kind, level=lvl, speedup=merged["O0"]["step_ms"] / row["step_ms"])
            out.append(row)
    return {"lm": str(vars(cfg["speed_lm"])), "cnn": str(cfg["speed_cnn"]), "rows": out, "sizes": cfg["sizes"]}


def bench_memory(cfg, device, threads, log):
    spec = cfg["memory_lm"]
    runs = [(lvl, ("lm", spec, lvl, cfg["memory_steps"], 0, str(device), threads)) for lvl in ampkit.OPT_LEVELS]
    merged = {lvl: _merge(res) for lvl, res in interleaved(runs, 1, log).items()}
    for lvl, row in merged.items():
        row.update(level=lvl, vs_O0=row["peak_mib"] / merged["O0"]["peak_mib"])
    return {"lm": str(vars(spec)), "rows": list(merged.values()), "sizes": cfg["sizes"]}


def bench_scaling(cfg, device, threads, log):
    base = cfg["speed_lm"]
    runs = []
    for d in cfg["scaling_d"]:
        spec = LMConfig(vocab=base.vocab, d_model=d, n_heads=8, n_layers=4, seq_len=cfg["scaling_seq"], batch=cfg["scaling_batch"])
        runs += [((d, lvl), ("lm", spec, lvl, cfg["scaling_steps"], 2, str(device), threads)) for lvl in ("O0", "O5")]
    merged = {key: _merge(res) for key, res in interleaved(runs, cfg["repeats"], log).items()}
    smallest = merged[(cfg["scaling_d"][0], "O0")]["params"]
    rows = []
    for (d, lvl), row in merged.items():
        o0 = merged[(d, "O0")]
        row.update(d_model=d, level=lvl, size=row["params"] / smallest,
                   speedup=o0["step_ms"] / row["step_ms"], mem_vs_O0=row["peak_mib"] / o0["peak_mib"])
        rows.append(row)
    return {"lm": f"n_layers=4, seq_len={cfg['scaling_seq']}, batch={cfg['scaling_batch']}, vocab={base.vocab}",
            "rows": rows, "sizes": cfg["sizes"]}


# --- 6. torch.compile: eager vs compiled ampkit vs compiled hand-written -----------------

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear", "aten::_scaled_mm")


def _is_matmul(op: str) -> bool:
    return op in MATMUL_OPS or op.startswith("aten::_scaled_dot_product")


def profiled_ms(loops: dict, batch, steps=3) -> dict:
    """Name -> (matmul, all) self CPU ms per step of each loop, over ``steps`` profiled steps
    each, the loops alternating step by step (a load that comes and goes hits them alike)."""
    out = {name: (0.0, 0.0) for name in loops}
    for _ in range(steps):
        for name, loop in loops.items():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                loop.step(*batch)
            events = prof.key_averages()
            matmul = sum(e.self_cpu_time_total for e in events if _is_matmul(e.key))
            total = sum(e.self_cpu_time_total for e in events)
            out[name] = (out[name][0] + matmul / 1e3 / steps, out[name][1] + total / 1e3 / steps)
    return out


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


def compile_worker(level, spec, steps, warmup, device, threads, variants, report):
    """In a fresh process: the loops of ``variants`` at ``level`` on the LM ``spec`` (AdamW),
    compiled ones warmed up (compiled) first, then alternating step by step, order rotated."""
    from torch._dynamo.utils import counters

    torch.set_num_threads(threads)
    device = torch.device(device)
    batches = [(x.to(device), y.to(device)) for x, y in lm_batches(spec, 2)]
    build = {
        "eager": lambda m: AmpkitLoop(m, level, lm_loss, "adamw"),
        "ampkit": lambda m: CompiledAmpkitLoop(m, level, lm_loss),
        "hand": lambda m: compiled_hand_loop(level, m, lm_loss, device),
    }
    loops, first_s, breaks = {}, {}, {}
    for name in variants:
        torch.manual_seed(0)
        loops[name] = build[name](TinyLM(spec).to(device))
        counters.clear()
        first_s[name] = sum(timed(loops[name].step, device, *batches[i % 2]) for i in range(warmup))
        breaks[name] = sum(counters["graph_break"].values())
        report(f"{level} {name}: built, {warmup} warm-up steps (compiling) {first_s[name]:.1f} s")
    times = {name: [] for name in variants}
    for i in range(steps):
        order = variants[i % len(variants):] + variants[: i % len(variants)]
        for name in order:
            times[name].append(timed(loops[name].step, device, *batches[i % 2]))
    ms = {name: 1e3 * median(t) for name, t in times.items()}
    report(f"{level}: {steps} steps alternating, " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()))
    row = {"level": level, "steps_per_variant": steps, "warmup_s": first_s, "graph_breaks": breaks,
           **{f"{name}_ms": v for name, v in ms.items()}}
    if "ampkit" in ms and "eager" in ms:
        row["compiled_speedup"] = ms["eager"] / ms["ampkit"]
    if "ampkit" in ms and "hand" in ms:
        row["ratio"] = ms["ampkit"] / ms["hand"]
    if device.type == "cpu" and "eager" in loops:  # self CPU time is all of a CPU step's op time
        prof = profiled_ms({name: loops[name] for name in ("eager", "ampkit") if name in loops}, batches[0])
        row["matmul_ms"] = {name: matmul for name, (matmul, _) in prof.items()}
        row["other_ms"] = {name: total - matmul for name, (matmul, total) in prof.items()}
        row["matmul_share"] = prof["eager"][0] / prof["eager"][1]
        row["bound"] = 1 / row["matmul_share"]
        row["stream_GBps"] = stream_gbps(device)
        row["optimizer_floor_ms"] = adamw_floor_bytes(loops["eager"].model, level) / row["stream_GBps"] / 1e6
        row["bound_floor"] = prof["eager"][1] / (prof["eager"][0] + row["optimizer_floor_ms"])
    return row


def bench_compile(cfg, device, threads, levels, log):
    """Per level: eager ampkit, compiled ampkit, compiled hand-written, one process each level;
    then, where O5 is among ``levels``, eager vs compiled ampkit at O0 and O5 on the speed-up family's transformer."""
    lm, big = cfg["compile_lm"], cfg["speed_lm"]
    rows, big_rows = [], []
    for lvl in levels:
        log(f"{lvl}: fresh process, LM {lm_shape(lm)}")
        rows.append(isolated(compile_worker, lvl, lm, cfg["compile_steps"], 3, str(device), threads,
                             ("eager", "ampkit", "hand") if lvl == "O0" or lvl in HALF else ("eager", "ampkit"),  # O6/O7: no hand loop
                             report=log))
    for lvl in cfg["compile_big"] if "O5" in levels else ():  # O5's target; without O5 here, minutes for O0 alone
        log(f"{lvl}: fresh process, transformer {lm_shape(big)}")
        big_rows.append(isolated(compile_worker, lvl, big, cfg["speed_steps"], 3, str(device), threads, ("eager", "ampkit"),
                                 report=log))
    return {"model": f"TinyLM {vars(lm)}", "params": params_of(TinyLM(lm)), "rows": rows,
            "transformer": f"TinyLM {vars(big)}", "transformer_rows": big_rows, "optimizer": "AdamW"}


def compile_levels(choice: str, device) -> list:
    """``all``, a comma-separated list, or ``native``: O0 and the levels that run natively fast here."""
    if choice == "all":
        return list(ampkit.OPT_LEVELS)
    if choice == "native":
        caps = ampkit.capabilities(device)
        return [lvl for lvl, gain in caps.levels.items() if lvl == "O0" or gain == "speed and memory"]
    return choice.split(",")


# --- 3. unscale + overflow check; host syncs ------------------------------------------

def _unscale_once(opt, params, grads):
    """One ``scale_loss`` exit: the block writes ``grads`` as a backward would, ampkit unscales them."""
    loss = torch.zeros((), device=grads[0].device)
    with ampkit.scale_loss(loss, opt):
        for p, g in zip(params, grads):
            p.grad = g
    opt.zero_grad()


def _inductor_kernel(dst, src, inv, flag):
    """What a one-pass kernel would do: half -> fp32, times ``inv``, non-finite flag."""
    x = src.float()
    dst.copy_(x * inv)
    flag.copy_(torch.maximum(flag, (~torch.isfinite(x)).any().float()))


def inductor_unscale(dsts, srcs, device):
    """Seconds per call of ``_inductor_kernel`` compiled by inductor (one kernel for every size),
    over the tensors one by one, or None when it cannot be compiled here (no C++ compiler)."""
    try:
        kernel = torch.compile(_inductor_kernel, dynamic=True, fullgraph=True)
        flag, inv = torch.zeros(1, device=device), torch.full((), 0.5, device=device)
        kernel(dsts[0], srcs[0], inv, flag)
    except Exception as e:  # noqa: BLE001 - any compiler failure means "not available here"
        print(f"  unscale: inductor kernel unavailable ({type(e).__name__}); row left out", file=sys.stderr)
        return None

    def run():
        for d, s in zip(dsts, srcs):
            kernel(d, s, inv, flag)
    return run


def bench_unscale(cfg, device, log):
    n = cfg["unscale_elements"]
    chunks = 64
    rows = []
    for level, dtype in (("O0", torch.float32), ("O5", torch.bfloat16), ("O2", torch.float16)):  # O1/O4: as O0
        model = nn.ParameterList([nn.Parameter(torch.zeros(n // chunks, device=device)) for _ in range(chunks)])
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        # O2's dynamic scale would shrink the grads every call; a static scale runs the same kernels.
        model, opt = ampkit.initialize(model, opt, opt_level=level, loss_scale=1.0, verbosity=0)
        params = list(model.parameters())
        grads = [torch.randn(n // chunks, device=device).to(dtype) for _ in params]
        src = torch.randn(n, device=device).to(dtype)
        dst = torch.empty_like(src)
        # The floor of any master-weight path: the bare half -> fp32 conversion copy.
        wide = torch.empty(n, device=device) if dtype != torch.float32 else None
        # The one-pass kernel stock torch lacks, generated by inductor, into reused fp32 buffers.
        fused = None
        if wide is not None:
            fused_out = [torch.empty(g.shape, device=device) for g in grads]
            fused = inductor_unscale(fused_out, grads, device)
        t_amp, t_copy, t_wide, t_fused = [], [], [], []
        for _ in range(cfg["unscale_iters"]):
            t_amp.append(timed(_unscale_once, device, opt, params, grads))
            t_copy.append(timed(dst.copy_, device, src))
            if wide is not None:
                t_wide.append(timed(wide.copy_, device, src))
            if fused is not None:
                t_fused.append(timed(fused, device))
        gb = n * src.element_size() / 1e9
        rows.append({
            "level": level, "grad_dtype": str(dtype).replace("torch.", ""), "elements": n, "tensors": chunks,
            "path": "fp32 grads: unscale + check in place" if wide is None else "half grads -> fp32 master grads: copy, unscale + check",
            "ampkit_GBps": gb / median(t_amp), "copy_GBps": gb / median(t_copy),
            "ratio": median(t_copy) / median(t_amp),
            "vs_conversion": None if wide is None else median(t_wide) / median(t_amp),
            "conversion_ratio": None if wide is None else median(t_copy) / median(t_wide),
            "inductor_ratio": median(t_copy) / median(t_fused) if t_fused else None,
        })
        log(f"{level} {rows[-1]['grad_dtype']} grads: {rows[-1]['ampkit_GBps']:.2f} GB/s, copy {rows[-1]['copy_GBps']:.2f} GB/s")
        del model, opt, params, grads, src, dst, wide
    log("host syncs per step at every level, 3 model sizes")
    return {"rows": rows, "syncs": count_syncs(device, cfg["sync_blocks"])}


class HostSyncCounter(TorchDispatchMode):
    """Counts, at the dispatcher, every op that makes the host wait for tensor values:
    ``_local_scalar_dense`` (behind ``.item()``, ``bool()``, ``float()``, ``int()`` of a tensor,
    from Python or C++) and the ops whose output shape depends on the data."""

    SYNCING = {torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero, torch.ops.aten.masked_select}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in self.SYNCING
        return func(*args, **(kwargs or {}))


def _syncs_per_step(step, steps=2) -> float:
    with HostSyncCounter() as counter:
        for _ in range(steps):
            step()
    return counter.count / steps


def count_syncs(device, blocks_per_model):
    """Host syncs per training step through the whole public API, for growing parameter counts."""
    rows = []
    for blocks in blocks_per_model:
        def make():
            torch.manual_seed(0)
            layers = [m for _ in range(blocks) for m in (nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU())]
            return nn.Sequential(*layers, nn.Linear(16, 1)).to(device)
        x, y = torch.randn(32, 16, device=device), torch.randn(32, 1, device=device)
        row = {"parameters": len(list(make().parameters()))}
        for level in ampkit.OPT_LEVELS:
            loop = AmpkitLoop(make(), level, F.mse_loss)
            loop.step(x, y)
            row[level] = _syncs_per_step(lambda: loop.step(x, y))
        for level in ("O1", "O5"):
            loop = hand_loop(level, make(), F.mse_loss, device)
            loop.step(x, y)
            row[f"hand {level}"] = _syncs_per_step(lambda: loop.step(x, y))
        rows.append(row)
    return rows


# --- tables --------------------------------------------------------------------------

def table(rows, columns):
    """``columns``: (header, key or function, format)."""
    def cell(r, key, fmt):
        v = key(r) if callable(key) else r.get(key)
        return "-" if v is None else fmt.format(v)
    head = [c[0] for c in columns]
    body = [[cell(r, k, f) for _, k, f in columns] for r in rows]
    return format_table(head, body)


MATMUL_COLUMNS = [  # compile family, CPU only: what compiling can gain at most (module docstring)
    ("matmul share", "matmul_share", "{:.2f}"), ("bound 1/share", "bound", "{:.2f}x"),
    ("optimizer floor ms", "optimizer_floor_ms", "{:.1f}"), ("bound with floor", "bound_floor", "{:.2f}x"),
    ("matmul ms e/c", lambda x: x.get("matmul_ms") and "{eager:.1f}/{ampkit:.1f}".format(**x["matmul_ms"]), "{}"),
    ("other ms e/c", lambda x: x.get("other_ms") and "{eager:.1f}/{ampkit:.1f}".format(**x["other_ms"]), "{}"),
]


def report(results, quick):
    out = []
    if "overhead" in results:
        r = results["overhead"]
        out += [f"\n1. Front-end overhead ({r['model']}; {r['rows'][0]['steps_per_variant']} steps per variant, "
                f"alternating; {r['wall_s']:.0f} s)", table(r["rows"], [
                    ("level", "level", "{}"), ("LM", "lm", "{}"), ("hand-written baseline", "baseline", "{}"),
                    ("ampkit ms", "ampkit_ms", "{:.2f}"), ("hand ms", "hand_ms", "{:.2f}"),
                    ("ratio", "ratio", "{:.3f}"),
                    ("per repeat", lambda x: " ".join(f"{v:.3f}" for v in x["ratio_per_repeat"]), "{}"),
                    ("fixed extra ms", "fixed_extra_ms", "{:+.3f}"),
                    ("skipped a/h", lambda x: f"{x['skipped']['ampkit']}/{x['skipped']['hand']}", "{}")])]
    if "speedup" in results:
        r = results["speedup"]
        out += [f"\n2. Speed-up from precision (LM {r['lm']}; CNN {r['cnn']}; {r['sizes']} sizes; {r['wall_s']:.0f} s)", table(r["rows"], [
            ("model", "model", "{}"), ("level", "level", "{}"), ("params", lambda x: x["params"] / 1e6, "{:.2f}M"),
            ("ms/step", "step_ms", "{:.1f}"), ("steps/s", "steps_per_s", "{:.2f}"), ("vs O0", "speedup", "{:.2f}x"),
            ("samples", "samples", "{}")])]
    if "unscale" in results:
        r = results["unscale"]
        out += [f"\n3a. Unscale + overflow check (GB/s = gradient bytes / time; copy = tensor.copy_ of the same bytes; "
                f"{r['wall_s']:.0f} s)",
                table(r["rows"], [
                    ("level", "level", "{}"), ("grads", "grad_dtype", "{}"), ("elements", lambda x: x["elements"] / 1e6, "{:.1f}M"),
                    ("path", "path", "{}"), ("ampkit GB/s", "ampkit_GBps", "{:.2f}"), ("copy GB/s", "copy_GBps", "{:.2f}"),
                    ("ratio", "ratio", "{:.2f}"),
                    ("vs half->fp32 copy", lambda x: "-" if x["vs_conversion"] is None else f"{x['vs_conversion']:.2f}", "{}"),
                    ("half->fp32 copy / copy", "conversion_ratio", "{:.2f}"),
                    ("inductor one-pass / copy", "inductor_ratio", "{:.2f}")]),
                "\n3b. Host syncs per training step (counted at the dispatcher: _local_scalar_dense, nonzero, masked_select)",
                table(r["syncs"], [(k, k, "{:g}") for k in r["syncs"][0]])]
    if "memory" in results:
        r = results["memory"]
        out += [f"\n4. Peak memory per level (LM {r['lm']}; RSS high-water above the fresh process's RSS before the model; "
                f"{r['sizes']} sizes; {r['wall_s']:.0f} s)",
                table(r["rows"], [("level", "level", "{}"), ("peak MiB", "peak_mib", "{:.0f}"), ("process RSS MiB", "rss_mib", "{:.0f}"),
                                  ("vs O0", "vs_O0", "{:.2f}x"), ("ms/step", "step_ms", "{:.0f}"), ("skipped", "skipped", "{}")])]
    if "scaling" in results:
        r = results["scaling"]
        out += [f"\n5. Scaling with model size ({r['lm']}; {r['sizes']} sizes; {r['wall_s']:.0f} s)", table(r["rows"], [
            ("d_model", "d_model", "{}"), ("params", lambda x: x["params"] / 1e6, "{:.1f}M"), ("size", "size", "x{:.1f}"),
            ("level", "level", "{}"), ("ms/step", "step_ms", "{:.1f}"), ("vs O0", "speedup", "{:.2f}x"),
            ("peak MiB", "peak_mib", "{:.0f}"), ("mem vs O0", "mem_vs_O0", "{:.2f}x")])]
    if "compile" in results:
        r = results["compile"]
        out += [f"\n6. torch.compile ({r['model']}, {r['params'] / 1e6:.2f}M params, {r['optimizer']}; compiled model "
                f"(fullgraph) + eager scale_loss + compiled optimizer step (O7: eager); variants alternate step by step; "
                f"{r['wall_s']:.0f} s)",
                table(r["rows"], [
                    ("level", "level", "{}"), ("eager ms", "eager_ms", "{:.2f}"), ("compiled ampkit ms", "ampkit_ms", "{:.2f}"),
                    ("compiled hand ms", "hand_ms", "{:.2f}"), ("ampkit / hand", "ratio", "{:.3f}"),
                    ("compiled vs eager", "compiled_speedup", "{:.2f}x"),
                    ("graph breaks a/h", lambda x: "{}/{}".format(x["graph_breaks"]["ampkit"], x["graph_breaks"].get("hand", "-")), "{}"),
                    *MATMUL_COLUMNS,
                    ("compile s a/h", lambda x: "{:.0f}/{}".format(x["warmup_s"]["ampkit"], "-" if "hand" not in x["warmup_s"] else f"{x['warmup_s']['hand']:.0f}"), "{}")])]
        if r["transformer_rows"]:
            out += [f"\n   transformer ({r['transformer']})", table(r["transformer_rows"], [
                ("level", "level", "{}"), ("eager ms", "eager_ms", "{:.1f}"), ("compiled ampkit ms", "ampkit_ms", "{:.1f}"),
                ("compiled vs eager", "compiled_speedup", "{:.2f}x"), *MATMUL_COLUMNS])]
    out += ["\nWall time per family (sizes: full, or small where the family's half dtype is emulated here)",
            table([{"family": f, **r} for f, r in results.items()],
                  [("family", "family", "{}"), ("sizes", "sizes", "{}"), ("seconds", "wall_s", "{:.0f}")])]
    targets = check_targets(results)
    if targets:
        out += ["\nTargets" + (" (--quick: sizes too small, not valid for the targets)" if quick else ""),
                table(targets, [("target", "target", "{}"), ("measured", "measured", "{}"), ("met", "met", "{}")])]
    return "\n".join(out)


def check_targets(results):
    t = []
    if "overhead" in results:
        for row in results["overhead"]["rows"]:
            t.append({"target": f"{row['level']} ampkit / hand-written <= 1.02", "measured": f"{row['ratio']:.3f}", "met": row["ratio"] <= 1.02})
    if "speedup" in results:
        o5 = next(r for r in results["speedup"]["rows"] if r["model"] == "lm" and r["level"] == "O5")
        small = " (small shapes: bf16 emulated here)" if results["speedup"]["sizes"] == "small" else ""
        t.append({"target": "O5 >= 2.5x O0 (LM)" + small, "measured": f"{o5['speedup']:.2f}x", "met": o5["speedup"] >= 2.5})
    if "unscale" in results:
        for row in results["unscale"]["rows"]:
            t.append({"target": f"unscale {row['grad_dtype']} grads >= 0.5 of copy", "measured": f"{row['ratio']:.2f}", "met": row["ratio"] >= 0.5})
        counts = {v for row in results["unscale"]["syncs"] for k, v in row.items() if k in ampkit.OPT_LEVELS}
        t.append({"target": "1 host sync per step, any param count", "measured": ",".join(f"{c:g}" for c in sorted(counts)), "met": counts == {1}})
    if "memory" in results:
        for row in results["memory"]["rows"]:
            if row["level"] in ("O3", "O5"):
                t.append({"target": f"{row['level']} peak memory <= 0.6x O0", "measured": f"{row['vs_O0']:.2f}x", "met": row["vs_O0"] <= 0.6})
    if "compile" in results:
        for row in (r for r in results["compile"]["rows"] if "ratio" in r):
            t.append({"target": f"{row['level']} compiled ampkit / compiled hand-written <= 1.02",
                      "measured": f"{row['ratio']:.3f}", "met": row["ratio"] <= 1.02})
        o5 = next((r for r in results["compile"]["transformer_rows"] if r["level"] == "O5"), None)
        if o5 is not None:
            bound = (f" (bounds: 1/matmul share {o5['bound']:.2f}x, with the optimizer's memory floor {o5['bound_floor']:.2f}x)"
                     if "bound" in o5 else "")
            t.append({"target": "O5 compiled >= 1.3x O5 eager (transformer, native bf16 CPU)",
                      "measured": f"{o5['compiled_speedup']:.2f}x{bound}", "met": o5["compiled_speedup"] >= 1.3})
    return t


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


def main(argv=None):
    p = argparse.ArgumentParser(description="ampkit benchmarks (see docs/benchmarks/)")
    p.add_argument("--quick", action="store_true", help="small sizes, one repeat: a smoke run, not valid for the targets")
    p.add_argument("--json", metavar="PATH", help="write machine, config and results as JSON")
    p.add_argument("--only", default=",".join(FAMILIES), help=f"comma-separated subset of {','.join(FAMILIES)}")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's, one less per busy core by the load average)")
    p.add_argument("--size", choices=("auto", "full", "small"), default="auto",
                   help="auto (the default): the small shapes for a family whose half dtype ampkit.capabilities() "
                        "calls emulated here, full elsewhere; full or small: those shapes everywhere")
    p.add_argument("--compile-levels", default="native",
                   help="levels of the compile family: native (O0 and those ampkit.capabilities() calls fast here; "
                        "the default), all, or a comma-separated list")
    args = p.parse_args(argv)
    only = args.only.split(",")
    unknown = set(only) - set(FAMILIES)
    if unknown:
        p.error(f"--only: unknown {sorted(unknown)}; choose from {','.join(FAMILIES)}")
    args.threads = args.threads or default_threads()
    torch.set_num_threads(args.threads)
    cfg, device = (QUICK if args.quick else FULL), torch.device(args.device)
    info = machine(device)
    print(f"ampkit {ampkit.__version__} benchmarks{' --quick' if args.quick else ''}: {info}", flush=True)
    size = args.size
    benches = {
        "overhead": lambda log: bench_overhead(cfg, device, args.threads, size, log),
        "speedup": lambda log: bench_speedup(sized(cfg, ("O0", "O4", "O5"), device, size), device, args.threads, log),
        "unscale": lambda log: bench_unscale(cfg, device, log),
        "memory": lambda log: bench_memory(sized(cfg, ampkit.OPT_LEVELS, device, size), device, args.threads, log),
        "scaling": lambda log: bench_scaling(sized(cfg, ("O0", "O5"), device, size), device, args.threads, log),
        "compile": lambda log: bench_compile(cfg, device, args.threads, compile_levels(args.compile_levels, device), log),
    }
    results, started = {}, time.perf_counter()
    for family in (f for f in FAMILIES if f in only):
        log = Log(family)
        log(f"start ({args.threads} threads)")
        results[family] = benches[family](log)
        results[family]["wall_s"] = time.perf_counter() - log.start
        results[family].setdefault("sizes", "quick" if args.quick else "full")
        log(f"done in {results[family]['wall_s']:.0f} s")
    finish(report(results, args.quick), info, args, started, results, check_targets(results))


if __name__ == "__main__":
    main()
