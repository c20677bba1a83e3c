"""1. overhead: ampkit O1/O4 vs a hand-written torch.autocast + torch.amp.GradScaler loop, and
   O2/O5 vs a hand-written half model + fp32 master loop; per level one fresh process in
   which the two variants alternate step by step, 3 repeats of 60 steps. The ratio is the median
   of the per-step ratios (each ampkit step over the hand-written step next to it, so a load that
   comes and goes hits both). Target: ratio <= 1.02.
"""
import time
from functools import partial
from statistics import median

import torch

from ampkit._cli.demo import isolated
from ampkit._cli.demo_models import LMConfig, TinyLM, lm_batches, lm_loss

from common import lm_shape, sized, table, timed
from loops import AmpkitLoop, hand_loop


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


def run(cfg, device, args, log) -> dict:
    return bench_overhead(cfg, device, args.threads, args.size, log)


def report(r) -> list:
    """The family's lines of run.py's report."""
    out = []
    out += [f"\n1. Front-end overhead ({r['model']}; {r['rows'][0]['steps_per_variant']} steps per variant, "
            f"alternating; {r['wall_s']:.0f} s)", table(r["rows"], [
                ("level", "level", "{}"), ("LM", "lm", "{}"), ("hand-written baseline", "baseline", "{}"),
                ("ampkit ms", "ampkit_ms", "{:.2f}"), ("hand ms", "hand_ms", "{:.2f}"),
                ("ratio", "ratio", "{:.3f}"),
                ("per repeat", lambda x: " ".join(f"{v:.3f}" for v in x["ratio_per_repeat"]), "{}"),
                ("fixed extra ms", "fixed_extra_ms", "{:+.3f}"),
                ("skipped a/h", lambda x: f"{x['skipped']['ampkit']}/{x['skipped']['hand']}", "{}")])]
    return out


def targets(res) -> list:
    """The family's rows of run.py's targets table."""
    t = []
    for row in res["rows"]:
        t.append({"target": f"{row['level']} ampkit / hand-written <= 1.02", "measured": f"{row['ratio']:.3f}", "met": row["ratio"] <= 1.02})
    return t
