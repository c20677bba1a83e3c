"""5. scaling: step time and peak memory of O0 and O5 at x1, x4, x16 parameters.
"""
from ampkit._cli.demo_models import LMConfig

from common import sized, table
from loops import _merge, interleaved


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


def run(cfg, device, args, log) -> dict:
    return bench_scaling(sized(cfg, ("O0", "O5"), device, args.size), device, args.threads, log)


def report(r) -> list:
    """The family's lines of run.py's report."""
    out = []
    out += [f"\n5. Scaling with model size ({r['lm']}; {r['sizes']} sizes; {r['wall_s']:.0f} s)", table(r["rows"], [
        ("d_model", "d_model", "{}"), ("params", lambda x: x["params"] / 1e6, "{:.1f}M"), ("size", "size", "x{:.1f}"),
        ("level", "level", "{}"), ("ms/step", "step_ms", "{:.1f}"), ("vs O0", "speedup", "{:.2f}x"),
        ("peak MiB", "peak_mib", "{:.0f}"), ("mem vs O0", "mem_vs_O0", "{:.2f}x")])]
    return out


def targets(res) -> list:
    return []
