"""4. memory: peak RSS per level on the transformer with an activation-heavy batch, one fresh
   process per level. Target: O3 and O5 <= 0.6x O0.
"""
import ampkit

from common import sized, table
from loops import _merge, interleaved


def bench_memory(cfg, device, threads, log):
    spec = cfg["memory_lm"]
    runs = [(lvl, ("lm", spec, lvl, cfg["memory_steps"], 0, str(device), threads)) for lvl in ampkit.OPT_LEVELS]
    merged = {lvl: _merge(res) for lvl, res in interleaved(runs, 1, log).items()}
    for lvl, row in merged.items():
        row.update(level=lvl, vs_O0=row["peak_mib"] / merged["O0"]["peak_mib"])
    return {"lm": str(vars(spec)), "rows": list(merged.values()), "sizes": cfg["sizes"]}


def run(cfg, device, args, log) -> dict:
    return bench_memory(sized(cfg, ampkit.OPT_LEVELS, device, args.size), device, args.threads, log)


def report(r) -> list:
    """The family's lines of run.py's report."""
    out = []
    out += [f"\n4. Peak memory per level (LM {r['lm']}; RSS high-water above the fresh process's RSS before the model; "
            f"{r['sizes']} sizes; {r['wall_s']:.0f} s)",
            table(r["rows"], [("level", "level", "{}"), ("peak MiB", "peak_mib", "{:.0f}"), ("process RSS MiB", "rss_mib", "{:.0f}"),
                              ("vs O0", "vs_O0", "{:.2f}x"), ("ms/step", "step_ms", "{:.0f}"), ("skipped", "skipped", "{}")])]
    return out


def targets(res) -> list:
    """The family's rows of run.py's targets table."""
    t = []
    for row in res["rows"]:
        if row["level"] in ("O3", "O5"):
            t.append({"target": f"{row['level']} peak memory <= 0.6x O0", "measured": f"{row['vs_O0']:.2f}x", "met": row["vs_O0"] <= 0.6})
    return t
