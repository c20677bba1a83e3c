"""9. o7_compile: O7's step (AdamW, fused: the declared op ``ampkit::adamw_bf16``) eager vs
   ``torch.compile``d, in one process on one model, the two alternating step by step (a load that
   comes and goes hits both); only ``optimizer.step()`` is timed, after a warm-up that compiles.
   Both run the same C kernel, so the compiled step can only lose Dynamo's guards and call
   overhead. Target: compiled / eager <= 1.0 (median step time).
"""
from statistics import median

import torch
from torch import nn

import ampkit

from common import table, timed


def _setup(width: int, layers: int):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return ampkit.initialize(model, opt, opt_level="O7", verbosity=0)


def run(cfg, device, args, log) -> dict:
    width, layers, steps = (256, 2, 6) if args.quick else (1024, 8, 200)
    runs = {}
    for name in ("eager", "compiled"):
        model, opt = _setup(width, layers)
        runs[name] = (model, opt, torch.compile(opt.step) if name == "compiled" else opt.step)
    x = torch.randn(32, width).bfloat16()
    times = {name: [] for name in runs}
    for i in range(steps + 3):
        for name, (model, opt, step) in (runs.items() if i % 2 else reversed(list(runs.items()))):
            opt.zero_grad()
            with ampkit.scale_loss(model(x).float().square().mean(), opt) as loss:
                loss.backward()
            seconds = timed(step, device)
            if i >= 3:  # the first steps compile
                times[name].append(seconds)
    same = all(torch.equal(a, b) for a, b in zip(runs["eager"][0].parameters(), runs["compiled"][0].parameters()))
    eager, compiled = median(times["eager"]), median(times["compiled"])
    log(f"eager {eager * 1e3:.2f} ms, compiled {compiled * 1e3:.2f} ms per step")
    return {"params": sum(p.numel() for p in runs["eager"][0].parameters()), "steps": steps, "threads": args.threads,
            "cpu": torch.backends.cpu.get_cpu_capability(), "eager_ms": eager * 1e3,
            "compiled_ms": compiled * 1e3, "ratio": compiled / eager, "same_bits": same}


def report(result: dict) -> list:
    return [f"\n9. O7 step, eager vs torch.compile (the fused op), {result['params']} bf16 parameters, "
            f"{result['steps']} steps each, alternating, {result['threads']} threads",
            table([result], [("eager ms", "eager_ms", "{:.2f}"), ("compiled ms", "compiled_ms", "{:.2f}"),
                             ("compiled / eager", "ratio", "{:.3f}"), ("same bits", "same_bits", "{}")])]


def targets(result: dict) -> list:
    return [{"target": "O7 compiled step / eager fused step <= 1.0", "measured": f"{result['ratio']:.3f}",
             "met": result["ratio"] <= 1.0 and result["same_bits"]}]
