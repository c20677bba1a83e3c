"""10. sgd_step: the whole training step with SGD momentum, the ImageNet recipe's optimizer
   (``torch.optim.SGD(lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=False)``), at O7, O7 with
   bf16 state, O8 and remainder masters against O5, and each level's fused update against its own
   eager path (``python benchmarks/run.py --only sgd_step [--quick]``). Targets, for both models:
   O7 <= 0.98x O5, O8 <= 1.05x, remainder <= 1.00x; every level's fused step <= its eager step.

Two models, one after the other: an MLP (3x32x32 flattened, two hidden ReLU layers, 10 classes) and
``ampkit._cli.demo_models.ConvNet`` (three conv + BatchNorm + ReLU stages, CIFAR-like 3x32x32 input),
on ``image_batches`` (seeded, cycled). The step: ``zero_grad``, forward, cross-entropy in fp32,
``scale_loss`` backward, ``step``. One model per level, built from the same seed; each is stepped
twice a round, once through the fused update (``AMPKIT_FUSED=1``) and once through the optimizer's
own step (``AMPKIT_FUSED=0``; the switch is read once a step), so a level's two paths share its
memory placement. Every (level, path) steps once per round, the order reversed on odd rounds, after
3 warm-up rounds; ratios are medians of the per-round ratios (a level's time over O5's on the same
path in the same round; a level's fused time over its eager time), ms are medians. Where a level has
no fused update for SGD, its two paths are the same and their ratio is noise about 1.
"""
import os
from statistics import median

import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit._cli.demo_models import ConvNet, image_batches
from ampkit._config.levels import OPT_LEVELS

from common import emulated, env_restored, table, timed

LEVELS = {"O5": ("O5", {}), "remainder": ("O5", {"master_weights": "remainder"}), "O7": ("O7", {}),
          "O7 bf16 state": ("O7", {"optimizer_state_dtype": torch.bfloat16}), "O8": ("O8", {})}
PATHS = {"fused": "1", "eager": "0"}  # AMPKIT_FUSED
SGD = dict(lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=False)
TARGETS = {"O7": 0.98, "O8": 1.05, "remainder": 1.00}  # step time over O5's
SIZES = {  # hidden: the MLP's width; width: the CNN's first stage; batch: both
    "full": dict(hidden=1024, width=32, batch=64, rounds=60),
    "small": dict(hidden=512, width=16, batch=32, rounds=60),  # where bf16 is emulated here
    "quick": dict(hidden=64, width=4, batch=4, rounds=3),
}


def mlp(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))


MODELS = {"mlp": lambda s: mlp(s["hidden"]), "cnn": lambda s: ConvNet(s["width"])}


def train_step(model, opt, x, y) -> None:
    opt.zero_grad()
    loss = F.cross_entropy(model(x).float(), y)
    with ampkit.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()


def build(kind: str, size: dict, level: str, overrides: dict, device):
    torch.manual_seed(0)
    model = MODELS[kind](size).to(device)
    opt = torch.optim.SGD(model.parameters(), **SGD)
    return ampkit.initialize(model, opt, opt_level=level, verbosity=0, **overrides)


def alternate(loops: dict, batches: list, rounds: int, device, log, kind: str) -> dict:
    """Per (level, path), the seconds of its step in each round after 3 warm-up rounds."""
    order = [(name, path) for name in loops for path in PATHS]
    times = {key: [] for key in order}
    for i in range(rounds + 3):
        x, y = batches[i % len(batches)]
        for name, path in order if i % 2 == 0 else order[::-1]:
            os.environ["AMPKIT_FUSED"] = PATHS[path]
            seconds = timed(train_step, device, *loops[name], x, y)
            if i >= 3:
                times[(name, path)].append(seconds)
        log(f"{kind}: round {i + 1}/{rounds + 3}" + (" (warm-up)" if i < 3 else ""))
    return times


def ratio(a: list, b: list) -> float:
    """The median of the per-round ratios a / b."""
    return median(x / y for x, y in zip(a, b))


def rows_of(kind: str, times: dict, params: int) -> list:
    out = []
    for name in dict.fromkeys(n for n, _ in times):
        fused, eager = times[(name, "fused")], times[(name, "eager")]
        out.append({"model": kind, "level": name, "params": params, "fused_ms": 1e3 * median(fused),
                    "eager_ms": 1e3 * median(eager), "vs_O5": ratio(fused, times[("O5", "fused")]),
                    "eager_vs_O5": ratio(eager, times[("O5", "eager")]), "fused_vs_eager": ratio(fused, eager)})
    return out


def bench_model(kind: str, size: dict, device, log) -> list:
    names = [n for n, (level, _) in LEVELS.items() if level in OPT_LEVELS]
    loops = {name: build(kind, size, *LEVELS[name], device) for name in names}
    batches = [(x.to(device), y.to(device)) for x, y in image_batches(4, size["batch"], 32)]
    params = sum(p.numel() for p in loops["O5"][0].parameters())
    log(f"{kind}: {params} parameters, {len(names)} levels x {len(PATHS)} paths, {size['rounds']} rounds")
    return rows_of(kind, alternate(loops, batches, size["rounds"], device, log, kind), params)


def run(cfg, device, args, log) -> dict:
    sizes = "quick" if args.quick else "small" if args.size == "small" or (
        args.size == "auto" and emulated(("O5",), device)) else "full"
    size = SIZES[sizes]
    with env_restored("AMPKIT_FUSED"):
        rows = [row for kind in MODELS for row in bench_model(kind, size, device, log)]
    return {"mlp": f"3072-{size['hidden']}-{size['hidden']}-10, batch {size['batch']}",
            "cnn": f"ConvNet(width={size['width']}), batch {size['batch']}x3x32x32", "rounds": size["rounds"],
            "threads": args.threads, "sizes": sizes, "optimizer": f"SGD({', '.join(f'{k}={v}' for k, v in SGD.items())})",
            "rows": rows}


def report(result: dict) -> list:
    return [f"\n10. SGD momentum whole step ({result['optimizer']}) against O5, and each level's fused update "
            f"against its eager path; MLP {result['mlp']}; CNN {result['cnn']}; {result['rounds']} rounds alternating, "
            f"{result['threads']} threads, {result['sizes']} sizes",
            table(result["rows"], [("model", "model", "{}"), ("level", "level", "{}"), ("params", "params", "{}"),
                                   ("fused ms", "fused_ms", "{:.2f}"), ("eager ms", "eager_ms", "{:.2f}"),
                                   ("vs O5", "vs_O5", "{:.3f}x"), ("eager vs O5 eager", "eager_vs_O5", "{:.3f}x"),
                                   ("fused / eager", "fused_vs_eager", "{:.3f}x")])]


def targets(result: dict) -> list:
    """O7, O8 and remainder masters against O5 per model; every level's fused step against its eager step."""
    out = []
    for r in result["rows"]:
        if r["level"] in TARGETS:
            limit = TARGETS[r["level"]]
            out.append({"target": f"SGD step {r['model']} {r['level']} <= {limit:.2f}x O5",
                        "measured": f"{r['vs_O5']:.3f}x", "met": r["vs_O5"] <= limit})
        out.append({"target": f"SGD step {r['model']} {r['level']} fused <= its eager step (AMPKIT_FUSED=0)",
                    "measured": f"{r['fused_vs_eager']:.3f}x", "met": r["fused_vs_eager"] <= 1.0})
    return out
