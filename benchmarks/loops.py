"""The training loops the families time: ampkit's README loop and the hand-written torch loops
it is compared with (autocast + GradScaler; half model + fp32 masters), eager and compiled;
and the fresh-process training runs of the speed-up, memory and scaling families."""
import math
from statistics import median

import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit._cli.demo import MemoryMeter, isolated, peak_rss_bytes
from ampkit._cli.demo_models import ConvNet, TinyLM, image_batches, lm_batches, lm_loss

from common import HALF, LR, lm_shape, params_of, timed  # benchmarks/common.py

def make_optimizer(params, kind="sgd"):
    """SGD with momentum (the default everywhere) or AdamW (the compile family)."""
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=LR / 10, eps=1e-4)  # 1e-8 rounds to 0 in fp16 (O3 steps on fp16)
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


class AmpkitLoop:
    """The README loop; ``opt`` (an optimizer over ``model``) instead of ``opt_kind``'s, ``overrides`` to ``initialize``."""

    def __init__(self, model, level, loss_fn, opt_kind="sgd", opt=None, **overrides):
        opt = opt or make_optimizer(model.parameters(), opt_kind)
        self.model, self.opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0, **overrides)
        self.loss_fn = loss_fn

    def predict(self, x):
        return self.model(x)

    def step(self, x, y):
        self.opt.zero_grad()
        loss = self.loss_fn(self.predict(x), y)
        with ampkit.scale_loss(loss, self.opt) as scaled:
            scaled.backward()
        self.opt.step()

    def skipped(self) -> int:
        return ampkit.loss_scalers(self.opt)[0].skipped_steps


class AutocastLoop:
    """Hand-written O1/O4: torch.autocast + torch.amp.GradScaler (init scale 2**16 or 1.0)."""

    def __init__(self, model, dtype, init_scale, loss_fn, device, opt_kind="sgd", opt=None):
        self.model, self.dtype, self.loss_fn, self.device = model, dtype, loss_fn, device
        self.opt = opt or make_optimizer(model.parameters(), opt_kind)
        self.init_scale = init_scale
        self.scaler = torch.amp.GradScaler(device.type, init_scale=init_scale)

    def predict(self, x):
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            return self.model(x).float()

    def step(self, x, y):
        self.opt.zero_grad()
        loss = self.loss_fn(self.predict(x), y)
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


# --- speed-up, memory, scaling: one fresh process per run ------------------------------

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
