"""Plot speed-up and peak memory per opt level from ``run.py --json`` output.

    python -m pip install -c constraints.txt -e ".[bench]"   # matplotlib
    python benchmarks/plot.py benchmarks/results/cpu.json benchmarks/results/cpu.png
"""
import argparse
import importlib.util
import json
import sys


def plot(results: dict, machine: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed, memory = results.get("speedup"), results.get("memory")
    if speed is None and memory is None:
        raise SystemExit("plot.py: the JSON has neither 'speedup' nor 'memory' results; run benchmarks/run.py with those families.")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    ax = axes[0]
    if speed is not None:
        models = sorted({r["model"] for r in speed["rows"]})
        levels = [r["level"] for r in speed["rows"] if r["model"] == models[0]]
        width = 0.8 / len(models)
        for i, model in enumerate(models):
            rows = {r["level"]: r for r in speed["rows"] if r["model"] == model}
            xs = [j + i * width for j in range(len(levels))]
            bars = ax.bar(xs, [rows[lvl]["speedup"] for lvl in levels], width, label=model.upper())
            ax.bar_label(bars, fmt="%.2fx", fontsize=8)
        ax.set_xticks([j + width * (len(models) - 1) / 2 for j in range(len(levels))], levels)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_ylabel("steps/s vs O0")
        ax.set_title("Speed-up from precision")
        ax.legend()
    ax = axes[1]
    if memory is not None:
        rows = memory["rows"]
        bars = ax.bar([r["level"] for r in rows], [r["vs_O0"] for r in rows], color="tab:green")
        ax.bar_label(bars, fmt="%.2fx", fontsize=8)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_ylabel("peak memory vs O0")
        ax.set_title("Peak memory (transformer, activation-heavy batch)")
    fig.suptitle(f"ampkit on {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, torch {machine.get('torch', '?')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description="plot ampkit benchmark results (speed-up and memory per level)")
    p.add_argument("json", help="a file written by benchmarks/run.py --json")
    p.add_argument("png", help="where to write the plot")
    args = p.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        sys.exit('plot.py needs matplotlib: python -m pip install -c constraints.txt -e ".[bench]"')
    with open(args.json) as f:
        data = json.load(f)
    plot(data["results"], data["machine"], args.png)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
