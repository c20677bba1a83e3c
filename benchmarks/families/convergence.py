"""8. convergence: does each level train as well as fp32 on real data? (issue 41; opt-in: ``--only convergence``)

Three tasks on data no one here wrote (``benchmarks/realdata.py``; nothing is downloaded, a missing data
set is reported with the command that installs it):

* ``cnn``: Fashion-MNIST, two conv + BatchNorm + max-pool stages (16 and 32 channels) and a hidden linear
  layer of 64, in channels-last memory format (106k parameters: the class of the data set's anchors
  "2 Conv+pooling+BN", 0.934, and "2 Conv <100K parameters", 0.925); final test accuracy on the 10k test images;
* ``mlp``: Fashion-MNIST, a 784-256-128-10 MLP (the anchor "MLP 256-128-100": 0.883);
* ``gpt``: the demo's causal transformer (``TinyLM``) on Debian's fortunes, byte level (vocab 256);
  final held-out loss in nats per byte on fixed windows of the held-out part.

Variants: ampkit's levels (O0-O8 where this ampkit has them; O6 where torchao imports), ``O5 remainder``
(``master_weights="remainder"``), ``O7 bf16 state`` (``optimizer_state_dtype=torch.bfloat16``), the
control ``O7 nearest (control)`` (``update_rounding="nearest"``), the hand-written ``torch.autocast``
fp16 + ``GradScaler`` loop (``loops.AutocastLoop``), and ``benchmarks/peers.py``'s optimizers on the
model cast to bf16 (its ``plain bf16 (control)``: torch's AdamW rounding every update to nearest;
torchao's stochastically rounded AdamW and AdamW8bit, optimi's Kahan AdamW, bitsandbytes' AdamW8bit,
each where it imports). Everyone gets AdamW with ``peers.ADAMW``'s betas, eps and weight decay, the
task's learning rate with a linear warm-up over the first 5% of the steps and a linear decay to 0.

A half dtype that this machine runs slowly on a task's model (a forward and backward of the model cast
to it over ``SLOW`` times fp32's, measured before the runs: float16 convolutions on many CPUs) runs its
variants on the MLP only; their rows on the other tasks say so. A row whose result needs reading with a
fact the table does not show carries it in its note (``NOTES``: O3's AdamW eps).

Seeds 0..n-1: a seed fixes the initial weights (``torch.manual_seed``), the order of the data
(a seeded generator) and the rounding (``ampkit.stochastic_rounding.manual_seed``; torchao draws from
torch's global generator). Per variant: the final metric's mean and spread over seeds, its gap to O0
paired by seed with the gap's standard error and 95% interval (Student's t), bytes per parameter
(``frontier.footprint``: ampkit's ``persistent_bytes``, or ``peers.state_bytes``), the median step
time against O0's and O5's in the same run (sequential runs: on a loaded machine indicative only),
the epochs (the training examples or bytes seen over the training set's size) and the held-out metric
against steps (on a fixed subset: the first 1000 test images, or all the held-out windows).
Each task trains all its variants and seeds in one fresh process (a variant that fails is reported so);
``--jobs N`` runs N tasks at once (their step times then share the machine too: compare them within a task).

Targets: every ampkit level within 0.3 accuracy points of O0 on Fashion-MNIST (its gap's 95% interval
reaching zero or above), within 0.01 nats on text; O7 bf16 state and O8 at least as close to O0 as the
peers in their memory class (within the level's standard error); the round-to-nearest controls behind
O0 (their gap's interval clear of zero on the worse side).
"""
import math
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from statistics import mean, median, stdev

import torch
import torch.nn.functional as F
from torch import nn

import peers  # benchmarks/peers.py
import realdata
from ampkit import float8
from ampkit._cli.demo import isolated
from ampkit._cli.demo_models import TinyLM, lm_loss
from ampkit._cli.progress import Progress
from ampkit._config.levels import OPT_LEVELS
from ampkit._common.text_table import format_table
from frontier import AMPKIT, first_line_of, footprint, seed_rounding
from loops import AmpkitLoop, AutocastLoop
from plot import convergence_metric, convergence_table

VARIANTS = {**{lvl: ("ampkit", (lvl, {})) for lvl in OPT_LEVELS}, **{n: ("ampkit", AMPKIT[n]) for n in AMPKIT},
            "autocast fp16 + GradScaler": ("autocast", torch.float16), **{n: ("peer", n) for n in peers.PEERS}}
CONTROLS = ("O7 nearest (control)", "plain bf16 (control)")
MEMORY_PEERS = {"O7 bf16 state": ("torchao AdamW SR", "optimi AdamW Kahan"),
                "O8": ("torchao AdamW8bit SR", "bnb AdamW8bit")}
SLOW = 2.0  # a half dtype whose forward and backward take over SLOW times fp32's runs on the MLP only
ACCURACY_POINTS, TEXT_NATS = 0.3, 0.01
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
CURVE_IMAGES = 1000
NOTES = {  # variant -> what its row needs said
    "O3": "fp16 weights and AdamW state, no masters (Apex's pure-fp16 speed baseline): AdamW's eps 1e-8 is 0 "
          "in fp16, so O3 needs a larger eps (1e-4 trains)",
}


# --- models and data -----------------------------------------------------------------------

def cnn() -> nn.Module:
    """In channels-last memory format: on the 2-core EPYC of the committed run (oneDNN, one thread) a
    forward and backward of this model at batch 128 took 1.6-1.7x less time so than in the default layout,
    in fp32 and in bf16, which buys the epochs the run needs."""
    def stage(c_in, c_out):
        return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(), nn.MaxPool2d(2)]
    model = nn.Sequential(*stage(1, 16), *stage(16, 32), nn.Flatten(), nn.Linear(32 * 7 * 7, 64), nn.ReLU(),
                          nn.Linear(64, 10))
    return model.to(memory_format=torch.channels_last)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))


def accuracy(logits, y):
    return (logits.argmax(-1) == y).float().mean()


class Images:
    """Fashion-MNIST batches in a seeded order, and the test images (``limit``: the first images of each only)."""
    loss_fn, score = staticmethod(F.cross_entropy), staticmethod(accuracy)

    def __init__(self, folder, batch, limit=None):
        data = realdata.fashion_mnist(folder)
        self.x, self.y = (t[:limit] for t in data["train"])
        self.test = tuple(t[:limit] for t in data["test"])
        self.curve = tuple(t[:CURVE_IMAGES] for t in self.test)
        self.batch = batch

    def epochs(self, steps):
        return steps * self.batch / len(self.y)

    def batches(self, steps, seed):
        g = torch.Generator().manual_seed(seed)
        per_epoch = len(self.y) // self.batch
        orders = [torch.randperm(len(self.y), generator=g) for _ in range(-(-steps // per_epoch))]
        for i in range(steps):
            idx = orders[i // per_epoch][(i % per_epoch) * self.batch:(i % per_epoch + 1) * self.batch]
            yield self.x[idx], self.y[idx]

    def held_out(self, final):
        """The test images (``final``) or the curve's subset of them, in chunks of 500."""
        x, y = self.test if final else self.curve
        return [(x[i:i + 500], y[i:i + 500]) for i in range(0, len(y), 500)]


class Text:
    """Byte windows of the fortunes at seeded positions; fixed held-out windows, evenly spaced."""
    loss_fn = score = staticmethod(lm_loss)

    def __init__(self, folder, spec, windows):
        self.train, rest = realdata.split_text(realdata.text_files(folder), 0.1)
        starts = torch.linspace(0, len(rest) - spec.seq_len - 2, windows).long()
        self.windows = self._cut(rest, starts, spec.seq_len)
        self.spec = spec

    def epochs(self, steps):
        return steps * self.spec.batch * self.spec.seq_len / len(self.train)

    @staticmethod
    def _cut(data, starts, n):
        rows = torch.stack([data[s:s + n + 1] for s in starts.tolist()]).long()
        return rows[:, :-1], rows[:, 1:]

    def batches(self, steps, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            starts = torch.randint(0, len(self.train) - self.spec.seq_len - 1, (self.spec.batch,), generator=g)
            yield self._cut(self.train, starts, self.spec.seq_len)

    def held_out(self, final):
        """The held-out windows in chunks of 32: the same for the curve and the end (``final``)."""
        x, y = self.windows
        return [(x[i:i + 32], y[i:i + 32]) for i in range(0, len(x), 32)]


def task(name, cfg, args):
    """``(data, model factory)`` of task ``name`` (raises ``realdata.MissingData``)."""
    folder = getattr(args, "fashion_mnist", None) or realdata.FASHION_MNIST
    if name == "gpt":
        spec = cfg["lm"]
        return Text(getattr(args, "text", None) or realdata.FORTUNES, spec, cfg["windows"]), lambda: TinyLM(spec)
    return Images(folder, cfg["batch"], cfg.get("limit")), (cnn if name == "cnn" else mlp)


# --- one variant's training ----------------------------------------------------------------

class PeerLoop:
    """A peer's optimizer (``benchmarks/peers.py``) on the model cast to bf16."""

    def __init__(self, name, model, loss_fn, lr):
        self.model = model.to(torch.bfloat16)
        self.opt, self.loss_fn = peers.make(name, self.model, lr), loss_fn

    def predict(self, x):
        return self.model(x.to(torch.bfloat16) if x.is_floating_point() else x).float()

    def step(self, x, y):
        self.opt.zero_grad()
        self.loss_fn(self.predict(x), y).backward()
        self.opt.step()


def make_loop(name, model, loss_fn, lr, seed):
    kind, arg = VARIANTS[name]
    if kind == "peer":
        return PeerLoop(arg, model, loss_fn, lr)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, **peers.ADAMW)
    if kind == "autocast":
        return AutocastLoop(model, arg, 2.0**16, loss_fn, torch.device("cpu"), opt=opt)
    loop = AmpkitLoop(model, arg[0], loss_fn, opt=opt, **arg[1])
    seed_rounding(loop.opt, seed)
    return loop


def set_lr(opt, lr):
    for group in opt.param_groups:
        if torch.is_tensor(group["lr"]):  # torchao keeps it as a tensor (a float would recompile its step)
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def schedule(lr, step, steps):
    """Linear warm-up over the first 5% of ``steps``, then linear decay to 0."""
    warm = max(1, steps // 20)
    return lr * min((step + 1) / warm, (steps - step) / (steps - warm))


@torch.no_grad()
def evaluate(loop, data, final):
    loop.model.eval()
    parts = [(data.score(loop.predict(x).float(), y).item(), len(y)) for x, y in data.held_out(final)]
    loop.model.train()
    return sum(s * n for s, n in parts) / sum(n for _, n in parts)


def train_seed(data, make_model, name, cfg, seed, progress):
    torch.manual_seed(seed)
    loop = make_loop(name, make_model(), data.loss_fn, cfg["lr"], seed)
    steps, every = cfg["steps"], max(1, cfg["steps"] // cfg["curve_points"])
    curve, times = [], []
    for i, (x, y) in enumerate(data.batches(steps, seed)):
        set_lr(loop.opt, schedule(cfg["lr"], i, steps))
        start = time.perf_counter()
        loop.step(x, y)
        times.append(time.perf_counter() - start)
        if (i + 1) % every == 0 and i + 1 < steps:
            curve.append((i + 1, evaluate(loop, data, False)))
            progress(i + 1)
    curve.append((steps, evaluate(loop, data, False)))
    loop.opt.zero_grad()
    return {"seed": seed, "final": evaluate(loop, data, True), "curve": curve, "step_ms": 1e3 * median(times[3:] or times),
            "epochs": data.epochs(steps), **footprint(loop.model, loop.opt, VARIANTS[name][0] == "ampkit")}


def train_variant(data, make_model, name, cfg, report):
    """Variant ``name`` from each seed (``report("step", done)`` as it goes), or why it failed here."""
    report("start", name)
    try:
        return [train_seed(data, make_model, name, cfg, seed, lambda done: report("step", seed * cfg["steps"] + done))
                for seed in range(cfg["seeds"])]
    except Exception as e:  # a peer that cannot run here
        return first_line_of(e)
    finally:
        report("finish")


def task_worker(task_name, names, cfg, threads, args, *, report):
    """In a fresh process: each of ``names`` on task ``task_name``: name -> its runs or why it did not run."""
    torch.set_num_threads(threads)
    try:
        data, make_model = task(task_name, cfg, args)
    except realdata.MissingData as e:
        return {"missing": str(e)}
    return {name: why or train_variant(data, make_model, name, cfg, report)
            for name, why in plan(task_name, data, make_model, names, report)}


# --- which variants run where --------------------------------------------------------------

def half_dtype(name):
    kind, arg = VARIANTS[name]
    return {"peer": torch.bfloat16, "autocast": arg}.get(kind) or OPT_LEVELS[arg[0]].half_dtype


def unavailable(name):
    """Why variant ``name`` cannot run here, or None."""
    kind, arg = VARIANTS[name]
    if kind == "peer":
        return peers.missing(arg)
    if kind == "ampkit" and OPT_LEVELS[arg[0]].fp8:
        try:
            float8.require()
        except ImportError as e:
            return first_line_of(e)
    return None


HALVES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def slow_dtypes(task_name, data, make_model, rounds=6):
    """Half dtypes in which a forward and backward of this task's model (cast to the dtype) take over
    ``SLOW`` times fp32's here: dtype -> ratio. The dtypes take turns, ``rounds`` times after a warm-up;
    each one's fastest pass counts (the one least disturbed by other work on the machine)."""
    if task_name == "mlp":
        return {}
    models = {name: make_model().to(dt) for name, dt in {"float32": torch.float32, **HALVES}.items()}
    x, y = next(data.batches(1, 0))
    best = dict.fromkeys(models, math.inf)
    for i in range(rounds + 1):
        for name, model in models.items():
            inputs = x.to(next(model.parameters()).dtype) if x.is_floating_point() else x
            start = time.perf_counter()
            data.loss_fn(model(inputs).float(), y).backward()
            best[name] = min(best[name], time.perf_counter() - start) if i else best[name]
    return {name: best[name] / best["float32"] for name in HALVES if best[name] > SLOW * best["float32"]}


# --- the family ----------------------------------------------------------------------------

def summarize(task_name, name, runs, base):
    """One table row: the final metric over seeds, the gap to O0 paired by seed, costs, the curve."""
    finals = [r["final"] for r in runs]
    row = {"task": task_name, "variant": name, "seeds": len(runs), "mean": mean(finals),
           "spread": max(finals) - min(finals), "step_ms": mean(r["step_ms"] for r in runs), "epochs": runs[0]["epochs"],
           "bytes_per_param": runs[0]["elementwise_bytes_per_param"],
           "curve": [[s, mean(r["curve"][i][1] for r in runs)] for i, (s, _) in enumerate(runs[0]["curve"])]}
    if name in NOTES:
        row["note"] = NOTES[name]
    paired = [r["final"] - base[r["seed"]] for r in runs if r["seed"] in base]
    if len(paired) > 1:
        se = stdev(paired) / math.sqrt(len(paired))
        half = T95.get(len(paired) - 1, 1.96) * se
        row.update(gap=mean(paired), gap_se=se, gap_low=mean(paired) - half, gap_high=mean(paired) + half)
    return row


def relative_times(rows):
    for row in rows:
        for ref in ("O0", "O5"):
            other = next((r for r in rows if r["task"] == row["task"] and r["variant"] == ref and "step_ms" in r), None)
            if other and "step_ms" in row:
                row[f"time_vs_{ref}"] = row["step_ms"] / other["step_ms"]


def plan(task_name, data, make_model, names, report):
    """``(name, why it is left out or None)`` for every variant on this task."""
    slow = slow_dtypes(task_name, data, make_model)
    report("log", f"{task_name}: half dtypes whose forward and backward take over {SLOW}x fp32's here: {slow or 'none'}")
    out = []
    for name in names:
        dtype = str(half_dtype(name)).removeprefix("torch.")
        why = unavailable(name) or (dtype in slow and f"{dtype} passes take {slow[dtype]:.1f}x fp32's here: on the MLP only")
        out.append((name, why or None))
    return out


def relay(bar, log, task_name, kind, *value):
    """A worker's report: a progress bar's ``start`` (of a variant of ``task_name``)/``step``/``finish``, or a ``log`` line."""
    if kind == "start":
        value = (f"{task_name} {value[0]}",)
    (log if kind == "log" else getattr(bar, kind))(*value)


def run_task(task_name, cfg, names, args, log):
    """``(rows, why the task did not run or None)``."""
    bar = Progress(len(names), cfg["seeds"] * cfg["steps"])
    runs = isolated(task_worker, task_name, names, cfg, args.threads, args, report=partial(relay, bar, log, task_name))
    if "missing" in runs:
        log(f"{task_name}: skipped, {runs['missing']}")
        return [], runs["missing"]
    return rows_of(task_name, runs), None


def rows_of(task_name, runs):
    base = {r["seed"]: r["final"] for r in runs["O0"]} if isinstance(runs.get("O0"), list) else {}
    rows = [summarize(task_name, n, r, base) if isinstance(r, list) else {"task": task_name, "variant": n, "skipped": r}
            for n, r in runs.items()]
    relative_times(rows)
    return rows


def run(cfg, device, args, log) -> dict:
    """Every task, ``args.jobs`` of them at once (each in its own process)."""
    conv = cfg["convergence"]
    names = [n for n in VARIANTS if VARIANTS[n][0] != "ampkit" or VARIANTS[n][1][0] in OPT_LEVELS]
    tasks = {name: {"seeds": conv["seeds"], "curve_points": conv["curve_points"], **task_cfg}  # a task may set its own seeds
             for name, task_cfg in conv["tasks"].items()}
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        done = dict(zip(tasks, pool.map(lambda t: run_task(t, tasks[t], names, args, log), tasks)))
    return {"tasks": {t: {k: str(v) if k == "lm" else v for k, v in c.items()} for t, c in tasks.items()},
            "rows": [row for rows, _ in done.values() for row in rows], "slow_factor": SLOW, "jobs": args.jobs,
            "missing": {t: why for t, (_, why) in done.items() if why}}


def report(r) -> list:
    out = []
    for task_name, cfg in r["tasks"].items():
        metric = convergence_metric(task_name)[0]
        epochs = next((row["epochs"] for row in r["rows"] if row["task"] == task_name and "epochs" in row), None)
        out += [f"\n8. convergence, {task_name}: {metric}, {cfg['steps']} steps x {cfg['seeds']} seeds"
                f"{f' ({epochs:.2g} epochs)' if epochs else ''} (lr {cfg['lr']:g}); gap to O0 paired by seed, "
                f"its standard error and 95% interval",
                format_table(*convergence_table(r["rows"], task_name))]
    out += [f"\n8. convergence, {t}: skipped, {why}" for t, why in r.get("missing", {}).items()]
    return out


def _within(row):
    """Whether ``row``'s gap meets its task's target, and the bound in the task's unit."""
    if row["task"] == "gpt":
        return row["gap"] <= TEXT_NATS, f"{TEXT_NATS} nats"
    return abs(row["gap"]) * 100 <= ACCURACY_POINTS and row["gap_high"] >= 0, f"{ACCURACY_POINTS} points"


def _measured(row):
    unit = convergence_metric(row["task"])[1]
    return f"{row['gap'] * unit:+.3f} (95% {row['gap_low'] * unit:+.3f}..{row['gap_high'] * unit:+.3f})"


def targets(res) -> list:
    out = []
    ampkit_rows = [r for r in res["rows"] if "gap" in r and VARIANTS[r["variant"]][0] == "ampkit"]
    for row in ampkit_rows:
        if row["variant"] in CONTROLS or row["variant"] == "O0":
            continue
        met, bound = _within(row)
        out.append({"target": f"{row['task']} {row['variant']} within {bound} of O0", "measured": _measured(row), "met": met})
    for row in (r for r in res["rows"] if "gap" in r and r["variant"] in CONTROLS):
        behind = row["gap_high"] < 0 if row["task"] != "gpt" else row["gap_low"] > 0
        out.append({"target": f"{row['task']} {row['variant']} behind O0", "measured": _measured(row), "met": behind})
    return out + memory_class_targets(res["rows"])


def memory_class_targets(rows):
    by = {(r["task"], r["variant"]): r for r in rows if "gap" in r}
    out = []
    for (task_name, name), row in by.items():
        for peer in MEMORY_PEERS.get(name, ()):
            if (task_name, peer) in by:
                other = by[(task_name, peer)]
                out.append({"target": f"{task_name} {name} as close to O0 as {peer}",
                            "measured": f"{_measured(row)} vs {_measured(other)}",
                            "met": abs(row["gap"]) <= abs(other["gap"]) + row["gap_se"]})
    return out
