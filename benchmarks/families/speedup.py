"""2. speedup: steps/s of O0, O4, O5 on the transformer (d_model 512) and the CNN, each
   repeat of each level in a fresh process, levels interleaved. Target: O5 >= 2.5x O0 (LM).
"""
from common import sized, table
from loops import _merge, interleaved


def bench_speedup(cfg, device, threads, log):
    out = []
    for kind, spec in (("lm", cfg["speed_lm"]), ("cnn", cfg["speed_cnn"])):
        runs = [(lvl, (kind, spec, lvl, cfg["speed_steps"], 2, str(device), threads)) for lvl in ("O0", "O4", "O5")]
        merged = {lvl: _merge(res) for lvl, res in interleaved(runs, cfg["repeats"], log).items()}
        for lvl, row in merged.items():
            row.update(model=kind, level=lvl, speedup=merged["O0"]["step_ms"] / row["step_ms"])
            out.append(row)
    return {"lm": str(vars(cfg["speed_lm"])), "cnn": str(cfg["speed_cnn"]), "rows": out, "sizes": cfg["sizes"]}


def run(cfg, device, args, log) -> dict:
    return bench_speedup(sized(cfg, ("O0", "O4", "O5"), device, args.size), device, args.threads, log)


def report(r) -> list:
    """The family's lines of run.py's report."""
    out = []
    out += [f"\n2. Speed-up from precision (LM {r['lm']}; CNN {r['cnn']}; {r['sizes']} sizes; {r['wall_s']:.0f} s)", table(r["rows"], [
        ("model", "model", "{}"), ("level", "level", "{}"), ("params", lambda x: x["params"] / 1e6, "{:.2f}M"),
        ("ms/step", "step_ms", "{:.1f}"), ("steps/s", "steps_per_s", "{:.2f}"), ("vs O0", "speedup", "{:.2f}x"),
        ("samples", "samples", "{}")])]
    return out


def targets(res) -> list:
    """The family's rows of run.py's targets table."""
    t = []
    o5 = next(r for r in res["rows"] if r["model"] == "lm" and r["level"] == "O5")
    small = " (small shapes: bf16 emulated here)" if res["sizes"] == "small" else ""
    t.append({"target": "O5 >= 2.5x O0 (LM)" + small, "measured": f"{o5['speedup']:.2f}x", "met": o5["speedup"] >= 2.5})
    return t
