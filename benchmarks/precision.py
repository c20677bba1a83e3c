"""What ``ampkit.precision_report`` costs, against the two fp32 training steps it runs.

    python benchmarks/precision.py [--repeats 3] [--json PATH]

For the demo LM and the demo CNN, each repeat in a fresh process (so peak RSS is the
report's own): the time of two plain fp32 training steps (AdamW, the same batches, on a deep
copy), then the time and peak-RSS rise of ``precision_report`` on the model with all levels.
Reported: the time ratio report / two steps (wall clock, and the CPU time of the process, which
load from other processes disturbs less), the extra time per measured layer, and the
memory rise against the model's parameters and gradients (one fp32 copy of both: 8 bytes per
parameter). Prints a table and writes JSON; nothing here runs in the unit tests.
"""
import argparse
import copy
import json
import os
import sys
import time
from statistics import median

import torch
import torch.nn.functional as F

import ampkit
from ampkit._cli.demo import DEMO_LM, MemoryMeter, isolated, machine
from ampkit._cli.demo_models import ConvNet, TinyLM, image_batches, lm_batches, lm_loss
from ampkit._common.text_table import format_table


def _model(name):
    torch.manual_seed(0)
    if name == "lm":
        return TinyLM(DEMO_LM), lm_batches(DEMO_LM, 2), lambda m, b: lm_loss(m(b[0]), b[1])
    return ConvNet(), image_batches(2, 32), lambda m, b: F.cross_entropy(m(b[0]), b[1])


def worker(name, threads, report=None):
    torch.set_num_threads(threads)
    model, batches, loss_fn = _model(name)
    copy_ = copy.deepcopy(model)
    opt = torch.optim.AdamW(copy_.parameters(), lr=1e-3)
    start, cpu = time.perf_counter(), time.process_time()
    for b in batches:
        opt.zero_grad()
        loss_fn(copy_, b).backward()
        opt.step()
    steps_s, steps_cpu = time.perf_counter() - start, time.process_time() - cpu
    del copy_, opt
    meter = MemoryMeter(torch.device("cpu"))
    start, cpu = time.perf_counter(), time.process_time()
    rep = ampkit.precision_report(model, loss_fn, batches, torch.optim.AdamW(model.parameters(), lr=1e-3))
    report_s, report_cpu = time.perf_counter() - start, time.process_time() - cpu
    layers = len([m for m in model.modules() if not list(m.children())])
    params = sum(p.numel() for p in model.parameters())
    return {"model": name, "two_steps_s": steps_s, "report_s": report_s, "two_steps_cpu_s": steps_cpu, "report_cpu_s": report_cpu, "layers": layers, "params": params,
            "rss_rise_mib": meter.peak_mib(), "param_grad_mib": 8 * params / 2**20, "rows": len(rep.to_dict()["layers"])}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--json", default="benchmarks/results/precision.json")
    args = ap.parse_args(argv)
    rows, start = [], time.perf_counter()
    for name in ("lm", "cnn"):
        runs = []
        for r in range(args.repeats):
            runs.append(isolated(worker, name, args.threads))
            print(f"[{time.perf_counter() - start:6.1f}s] {name} repeat {r + 1}/{args.repeats}: report "
                  f"{runs[-1]['report_s']:.2f}s, two steps {runs[-1]['two_steps_s']:.2f}s", file=sys.stderr, flush=True)
        keys = ("two_steps_s", "report_s", "two_steps_cpu_s", "report_cpu_s", "rss_rise_mib")
        row = dict(runs[0], **{k: median(r[k] for r in runs) for k in keys})
        row["ratio"] = row["report_s"] / row["two_steps_s"]
        row["cpu_ratio"] = row["report_cpu_s"] / row["two_steps_cpu_s"]
        row["extra_ms_per_layer"] = 1e3 * (row["report_s"] - row["two_steps_s"]) / row["layers"]
        rows.append(row)
    print(format_table(["model", "params", "layers", "two fp32 steps s", "report s", "ratio", "extra ms/layer",
                        "CPU s: steps / report", "CPU ratio", "RSS rise MiB", "params+grads MiB"],
                       [[r["model"], str(r["params"]), str(r["layers"]), f"{r['two_steps_s']:.2f}", f"{r['report_s']:.2f}",
                         f"{r['ratio']:.2f}", f"{r['extra_ms_per_layer']:.1f}",
                         f"{r['two_steps_cpu_s']:.2f} / {r['report_cpu_s']:.2f}", f"{r['cpu_ratio']:.2f}",
                         f"{r['rss_rise_mib']:.0f}", f"{r['param_grad_mib']:.0f}"] for r in rows]))
    result = {"machine": machine(torch.device("cpu")), "threads": args.threads, "repeats": args.repeats,
              "load_average": os.getloadavg(), "rows": rows}
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"load average {os.getloadavg()[0]:.2f}; JSON: {args.json}")


if __name__ == "__main__":
    main()
