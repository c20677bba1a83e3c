"""Plot speed-up and peak memory per opt level from ``run.py --json`` output; for the convergence
family's JSON, its held-out curves, and its tables as text cells (the report's and the docs' tables).

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


CONVERGENCE_UNITS = {"gpt": ("held-out loss (nats/byte)", 1, "{:.4f}", 0.5)}  # the image tasks: accuracy in %
ACCURACY = ("test accuracy (%)", 100, "{:.2f}", 5.0)


def convergence_metric(task: str) -> tuple:
    """``(label, factor to the shown unit, format, a gap to O0 off the curves' scale)`` of a convergence task's metric."""
    return CONVERGENCE_UNITS.get(task, ACCURACY)


def convergence_table(rows: list, task: str) -> tuple:
    """``(headers, cells)`` of the convergence family's table for ``task`` (every cell a string)."""
    _, unit, fmt, _ = convergence_metric(task)

    def num(row, key, form, scale=1.0):
        return "-" if row.get(key) is None else form.format(row[key] * scale)

    headers = ["variant", "mean", "spread", "gap to O0", "SE", "95% interval", "bytes/param", "time vs O0",
               "time vs O5", "note"]
    cells = [[r["variant"], num(r, "mean", fmt, unit), num(r, "spread", fmt, unit), num(r, "gap", "{:+.3f}", unit),
              num(r, "gap_se", "{:.3f}", unit),
              "-" if "gap_low" not in r else f"{r['gap_low'] * unit:+.3f}..{r['gap_high'] * unit:+.3f}",
              num(r, "bytes_per_param", "{:.2f}"), num(r, "time_vs_O0", "{:.2f}x"), num(r, "time_vs_O5", "{:.2f}x"),
              r.get("skipped") or r.get("note", "")] for r in rows if r["task"] == task]
    return headers, cells


def plot_convergence(result: dict, machine: dict, path) -> None:
    """Per task, the held-out metric against steps (mean over seeds) and, below, its difference from O0's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(result["tasks"])
    rows = [r for r in result["rows"] if r.get("curve")]
    names = list(dict.fromkeys(r["variant"] for r in rows))
    colors = plt.get_cmap("tab20")
    fig, axes = plt.subplots(2, len(tasks), figsize=(4.6 * len(tasks) + 2.4, 7), squeeze=False, sharex="col")
    for col, task in enumerate(tasks):
        label, unit, _, off_scale = convergence_metric(task)
        mine = [r for r in rows if r["task"] == task]
        base = next((r["curve"] for r in mine if r["variant"] == "O0"), None)
        off = [r for r in mine if abs(r.get("gap", 0) * unit) > off_scale]
        for r in (r for r in mine if r not in off):
            style = dict(color=colors(names.index(r["variant"]) % 20), linewidth=1.2, label=r["variant"],
                         linestyle="--" if "control" in r["variant"] else "-" if r["variant"][:1] == "O" else ":")
            steps = [s for s, _ in r["curve"]]
            axes[0][col].plot(steps, [v * unit for _, v in r["curve"]], **style)
            if base is not None:
                axes[1][col].plot(steps, [(v - b) * unit for (_, v), (_, b) in zip(r["curve"], base)], **style)
        axes[0][col].set(title=task + "".join(f"\n{r['variant']} off the scale: {r['gap'] * unit:+.2f}" for r in off),
                         ylabel=label)
        axes[1][col].set(xlabel="step", ylabel="minus O0's")
    handles = {h.get_label(): h for ax in axes.flat for h in ax.get_lines()}
    fig.legend([handles[n] for n in names if n in handles], [n for n in names if n in handles], loc="center right",
               fontsize=7)
    fig.suptitle(f"Held-out metric against steps, mean over seeds: {machine.get('cpu', '?')}, torch {machine.get('torch', '?')}",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0, 1 - 2.2 / (4.6 * len(tasks) + 2.4), 1))
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description="plot ampkit benchmark results (speed-up and memory per level)")
    p.add_argument("json", help="a file written by benchmarks/run.py --json")
    p.add_argument("png", help="where to write the plot")
    args = p.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        sys.exit('plot.py needs matplotlib: python -m pip install -c constraints.txt -e ".[bench]"')
    with open(args.json) as f:
        data = json.load(f)
    if "convergence" in data["results"]:
        plot_convergence(data["results"]["convergence"], data["machine"], args.png)
    else:
        plot(data["results"], data["machine"], args.png)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
