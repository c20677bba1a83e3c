"""6. compile: per level, eager ampkit vs compiled ampkit (the README pattern: compiled model,
   eager scale_loss, compiled optimizer step) vs the hand-written loop compiled the same way,
   AdamW, one fresh process per level, the three alternating step by step; then eager vs
   compiled at O0/O5 on the speed-up family's transformer (where O5 is among the levels). O6/O7 have no hand-written loop, and
   at O7 only the model is compiled (the README's pattern there). Targets: compiled ampkit <= 1.02x
   compiled hand-written; O5 compiled >= 1.3x O5 eager (transformer, native-bf16 CPU). On a
   CPU each row also profiles 3 eager and 3 compiled steps, alternating (self CPU time in matmul
   kernels and in all other ops): the matmuls' share s of the eager step bounds what compiling,
   which leaves the matmuls to the same oneDNN kernels, can gain: at most 1/s. A tighter bound
   adds the optimizer's memory floor: AdamW must read and write every weight (or master) and
   its two fp32 state tensors, read every gradient, and at O2/O5 write the model's half copy
   (28 bytes per parameter at O0 and O5), which takes at least those bytes over the bandwidth
   of a large same-dtype copy measured in the same process.
"""
from statistics import median

import torch

import ampkit
from ampkit._cli.demo import isolated
from ampkit._cli.demo_models import TinyLM, lm_batches, lm_loss

from common import HALF, adamw_floor_bytes, lm_shape, params_of, stream_gbps, table, timed
from loops import AmpkitLoop, CompiledAmpkitLoop, compiled_hand_loop


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear", "aten::_scaled_mm")


def _is_matmul(op: str) -> bool:
    return op in MATMUL_OPS or op.startswith("aten::_scaled_dot_product")


def profiled_ms(loops: dict, batch, steps=3) -> dict:
    """Name -> (matmul, all) self CPU ms per step of each loop, over ``steps`` profiled steps
    each, the loops alternating step by step (a load that comes and goes hits them alike)."""
    out = {name: (0.0, 0.0) for name in loops}
    for _ in range(steps):
        for name, loop in loops.items():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                loop.step(*batch)
            events = prof.key_averages()
            matmul = sum(e.self_cpu_time_total for e in events if _is_matmul(e.key))
            total = sum(e.self_cpu_time_total for e in events)
            out[name] = (out[name][0] + matmul / 1e3 / steps, out[name][1] + total / 1e3 / steps)
    return out


def compile_worker(level, spec, steps, warmup, device, threads, variants, report):
    """In a fresh process: the loops of ``variants`` at ``level`` on the LM ``spec`` (AdamW),
    compiled ones warmed up (compiled) first, then alternating step by step, order rotated."""
    from torch._dynamo.utils import counters

    torch.set_num_threads(threads)
    device = torch.device(device)
    batches = [(x.to(device), y.to(device)) for x, y in lm_batches(spec, 2)]
    build = {
        "eager": lambda m: AmpkitLoop(m, level, lm_loss, "adamw"),
        "ampkit": lambda m: CompiledAmpkitLoop(m, level, lm_loss),
        "hand": lambda m: compiled_hand_loop(level, m, lm_loss, device),
    }
    loops, first_s, breaks = {}, {}, {}
    for name in variants:
        torch.manual_seed(0)
        loops[name] = build[name](TinyLM(spec).to(device))
        counters.clear()
        first_s[name] = sum(timed(loops[name].step, device, *batches[i % 2]) for i in range(warmup))
        breaks[name] = sum(counters["graph_break"].values())
        report(f"{level} {name}: built, {warmup} warm-up steps (compiling) {first_s[name]:.1f} s")
    times = {name: [] for name in variants}
    for i in range(steps):
        order = variants[i % len(variants):] + variants[: i % len(variants)]
        for name in order:
            times[name].append(timed(loops[name].step, device, *batches[i % 2]))
    ms = {name: 1e3 * median(t) for name, t in times.items()}
    report(f"{level}: {steps} steps alternating, " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()))
    row = {"level": level, "steps_per_variant": steps, "warmup_s": first_s, "graph_breaks": breaks,
           **{f"{name}_ms": v for name, v in ms.items()}}
    if "ampkit" in ms and "eager" in ms:
        row["compiled_speedup"] = ms["eager"] / ms["ampkit"]
    if "ampkit" in ms and "hand" in ms:
        row["ratio"] = ms["ampkit"] / ms["hand"]
    if device.type == "cpu" and "eager" in loops:  # self CPU time is all of a CPU step's op time
        prof = profiled_ms({name: loops[name] for name in ("eager", "ampkit") if name in loops}, batches[0])
        row["matmul_ms"] = {name: matmul for name, (matmul, _) in prof.items()}
        row["other_ms"] = {name: total - matmul for name, (matmul, total) in prof.items()}
        row["matmul_share"] = prof["eager"][0] / prof["eager"][1]
        row["bound"] = 1 / row["matmul_share"]
        row["stream_GBps"] = stream_gbps(device)
        row["optimizer_floor_ms"] = adamw_floor_bytes(loops["eager"].model, level) / row["stream_GBps"] / 1e6
        row["bound_floor"] = prof["eager"][1] / (prof["eager"][0] + row["optimizer_floor_ms"])
    return row


def bench_compile(cfg, device, threads, levels, log):
    """Per level: eager ampkit, compiled ampkit, compiled hand-written, one process each level;
    then, where O5 is among ``levels``, eager vs compiled ampkit at O0 and O5 on the speed-up family's transformer."""
    lm, big = cfg["compile_lm"], cfg["speed_lm"]
    rows, big_rows = [], []
    for lvl in levels:
        log(f"{lvl}: fresh process, LM {lm_shape(lm)}")
        rows.append(isolated(compile_worker, lvl, lm, cfg["compile_steps"], 3, str(device), threads,
                             ("eager", "ampkit", "hand") if lvl == "O0" or lvl in HALF else ("eager", "ampkit"),  # O6/O7: no hand loop
                             report=log))
    for lvl in cfg["compile_big"] if "O5" in levels else ():  # O5's target; without O5 here, minutes for O0 alone
        log(f"{lvl}: fresh process, transformer {lm_shape(big)}")
        big_rows.append(isolated(compile_worker, lvl, big, cfg["speed_steps"], 3, str(device), threads, ("eager", "ampkit"),
                                 report=log))
    return {"model": f"TinyLM {vars(lm)}", "params": params_of(TinyLM(lm)), "rows": rows,
            "transformer": f"TinyLM {vars(big)}", "transformer_rows": big_rows, "optimizer": "AdamW"}


def compile_levels(choice: str, device) -> list:
    """``all``, a comma-separated list, or ``native``: O0 and the levels that run natively fast here."""
    if choice == "all":
        return list(ampkit.OPT_LEVELS)
    if choice == "native":
        caps = ampkit.capabilities(device)
        return [lvl for lvl, gain in caps.levels.items() if lvl == "O0" or gain == "speed and memory"]
    return choice.split(",")


MATMUL_COLUMNS = [  # compile family, CPU only: what compiling can gain at most (module docstring)
    ("matmul share", "matmul_share", "{:.2f}"), ("bound 1/share", "bound", "{:.2f}x"),
    ("optimizer floor ms", "optimizer_floor_ms", "{:.1f}"), ("bound with floor", "bound_floor", "{:.2f}x"),
    ("matmul ms e/c", lambda x: x.get("matmul_ms") and "{eager:.1f}/{ampkit:.1f}".format(**x["matmul_ms"]), "{}"),
    ("other ms e/c", lambda x: x.get("other_ms") and "{eager:.1f}/{ampkit:.1f}".format(**x["other_ms"]), "{}"),
]


def run(cfg, device, args, log) -> dict:
    return bench_compile(cfg, device, args.threads, compile_levels(args.compile_levels, device), log)


def report(r) -> list:
    """The family's lines of run.py's report."""
    out = []
    out += [f"\n6. torch.compile ({r['model']}, {r['params'] / 1e6:.2f}M params, {r['optimizer']}; compiled model "
            f"(fullgraph) + eager scale_loss + compiled optimizer step (O7: eager); variants alternate step by step; "
            f"{r['wall_s']:.0f} s)",
            table(r["rows"], [
                ("level", "level", "{}"), ("eager ms", "eager_ms", "{:.2f}"), ("compiled ampkit ms", "ampkit_ms", "{:.2f}"),
                ("compiled hand ms", "hand_ms", "{:.2f}"), ("ampkit / hand", "ratio", "{:.3f}"),
                ("compiled vs eager", "compiled_speedup", "{:.2f}x"),
                ("graph breaks a/h", lambda x: "{}/{}".format(x["graph_breaks"]["ampkit"], x["graph_breaks"].get("hand", "-")), "{}"),
                *MATMUL_COLUMNS,
                ("compile s a/h", lambda x: "{:.0f}/{}".format(x["warmup_s"]["ampkit"], "-" if "hand" not in x["warmup_s"] else f"{x['warmup_s']['hand']:.0f}"), "{}")])]
    if r["transformer_rows"]:
        out += [f"\n   transformer ({r['transformer']})", table(r["transformer_rows"], [
            ("level", "level", "{}"), ("eager ms", "eager_ms", "{:.1f}"), ("compiled ampkit ms", "ampkit_ms", "{:.1f}"),
            ("compiled vs eager", "compiled_speedup", "{:.2f}x"), *MATMUL_COLUMNS])]
    return out


def targets(res) -> list:
    """The family's rows of run.py's targets table."""
    t = []
    for row in (r for r in res["rows"] if "ratio" in r):
        t.append({"target": f"{row['level']} compiled ampkit / compiled hand-written <= 1.02",
                  "measured": f"{row['ratio']:.3f}", "met": row["ratio"] <= 1.02})
    o5 = next((r for r in res["transformer_rows"] if r["level"] == "O5"), None)
    if o5 is not None:
        bound = (f" (bounds: 1/matmul share {o5['bound']:.2f}x, with the optimizer's memory floor {o5['bound_floor']:.2f}x)"
                 if "bound" in o5 else "")
        t.append({"target": "O5 compiled >= 1.3x O5 eager (transformer, native bf16 CPU)",
                  "measured": f"{o5['compiled_speedup']:.2f}x{bound}", "met": o5["compiled_speedup"] >= 1.3})
    return t
