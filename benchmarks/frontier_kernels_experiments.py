"""The measurements in benchmarks/FRONTIER_KERNELS.md: ``python benchmarks/frontier_kernels_experiments.py``
from the repository root (CPU, one thread, a few minutes)."""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from ampkit._kernels.blockquant import dequantize, num_blocks, quantize_  # noqa: E402
from ampkit.stochastic_rounding import round_all_to_bf16_  # noqa: E402
from remainder_simulation import OPTIMIZERS, dyadic, simulate  # noqa: E402


def gaussian(shape, g):
    return torch.randn(shape, generator=g)


def remainder_runs(seeds=range(10)):
    """Remainder masters against O5, summed over seeds, for dyadic and Gaussian data."""
    for name, data in (("dyadic", dyadic), ("gaussian", gaussian)):
        for opt in sorted(OPTIMIZERS):
            for enc in ("remainder", "losing_ties"):
                runs = [simulate(opt, enc, seed=s, data=data) for s in seeds]
                diverged = sum(r["first_model_difference"] is not None for r in runs)
                first = [r["first_model_difference"] for r in runs if r["first_model_difference"] is not None]
                print(f"{name:8} {opt:7} {enc:11} ties {sum(r['ties'] for r in runs):5} lost {sum(r['lost'] for r in runs):5} "
                      f"runs whose model left O5's {diverged}/{len(runs)} (first at steps {first}) "
                      f"max master drift {max(r['max_master_ulps'] for r in runs):.0f} ULP, "
                      f"max final loss gap {max(abs(r['losses'][0] - r['losses'][1]) for r in runs):.2g}")


def remainder_wide_runs():
    """Wider MLPs (more element-steps, so more values no encoding keeps): when does the model
    first leave O5's?"""
    for hidden, opt in ((4096, "adamw"), (4096, "sgd"), (32768, "adamw")):  # SGD at 32768 overflows, in O5 too
        r = simulate(opt, "remainder", data=gaussian, hidden=hidden)
        print(f"hidden {hidden:6} ({25 * hidden + 8} params) {opt:6} ties {r['ties']} lost {r['lost']} "
              f"steps with model != O5 {r['model_differs']}/200 (first {r['first_model_difference']}) "
              f"max master drift {r['max_master_ulps']:.0f} ULP, final losses {r['losses'][0]:.6g} / {r['losses'][1]:.6g}")


# -- 8-bit Adam state -------------------------------------------------------------------------

class Block8:
    """Adam's two moments stored in 8 bits: exp_avg int8; exp_avg_sq by ``v_code``."""

    def __init__(self, n, v_code, seed):
        self.n, self.v_code, self.g = n, v_code, torch.Generator().manual_seed(seed)
        self.m = (torch.zeros(n, dtype=torch.int8), torch.zeros(num_blocks(n)))
        dtype = torch.int8 if v_code.startswith("int8") else torch.uint8
        self.v = (torch.zeros(n, dtype=dtype), torch.zeros(num_blocks(n)))

    def widen(self):
        m, v = dequantize(*self.m, torch.empty(self.n)), dequantize(*self.v, torch.empty(self.n))
        return m, (v.square_() if self.v_code.endswith("sqrt") else v)

    def narrow(self, m, v):
        quantize_(*self.m, m, self.g)
        quantize_(*self.v, v.sqrt() if self.v_code.endswith("sqrt") else v, self.g)


def mlp_task(seed=0, d_in=32, hidden=256, classes=10, n=4096):
    """A teacher-labelled classification task and a two-layer MLP's flat initial weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    teacher = torch.randn(d_in, classes, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(n, classes, generator=g)).argmax(1)
    shapes = [(hidden, d_in), (hidden,), (hidden, hidden), (hidden,), (classes, hidden), (classes,)]
    flat = torch.cat([(torch.randn(s, generator=g) / (s[-1] ** 0.5 if len(s) == 2 else 10)).flatten() for s in shapes])
    return x, y, shapes, flat


def forward_loss(flat, shapes, x, y, dtype):
    ps, at = [], 0
    for s in shapes:
        k = torch.Size(s).numel()
        ps.append(flat[at:at + k].view(s).to(dtype))
        at += k
    h = torch.nn.functional.linear(x.to(dtype), ps[0], ps[1]).relu()
    h = torch.nn.functional.linear(h, ps[2], ps[3]).relu()
    return torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, ps[4], ps[5]).float(), y)


def adam_run(state="fp32", weights="fp32", steps=300, seed=0, lr=3e-3):
    """Adam (torch.optim.Adam on one flat fp32 tensor); the state is widened from 8 bits
    before each step and re-quantized after when ``state`` names a v code; bf16 weights are
    stepped as fp32 copies rounded back stochastically. Returns the last 20 steps' mean loss
    and a held-out loss."""
    x, y, shapes, flat = mlp_task()
    xt, yt = x[:3072], y[:3072]
    w = flat.bfloat16() if weights == "bf16" else flat.clone()
    p = torch.nn.Parameter(w.float())
    opt = torch.optim.Adam([p], lr=lr, foreach=False)
    store = None if state == "fp32" else Block8(p.numel(), state, seed)
    g, rg, losses = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1), []
    for step in range(steps):
        idx = torch.randint(0, 3072, (128,), generator=g)
        p.data.copy_(w)
        loss = forward_loss(p, shapes, xt[idx], yt[idx], torch.bfloat16 if weights == "bf16" else torch.float32)
        p.grad, = torch.autograd.grad(loss, p)
        if store is not None and step:
            st = opt.state[p]
            st["exp_avg"], st["exp_avg_sq"] = store.widen()
        opt.step()
        if store is not None:
            st = opt.state[p]
            store.narrow(st["exp_avg"], st["exp_avg_sq"])
        if weights == "bf16":
            round_all_to_bf16_([w], [p.detach().clone()], rg)
        else:
            w = p.detach().clone()
        losses.append(loss.item())
    with torch.no_grad():
        held = forward_loss(w.float(), shapes, x[3072:], y[3072:], torch.float32).item()
    return sum(losses[-20:]) / 20, held


def adam_runs(seeds=range(6)):
    """Final losses per state code and weight type, with the paired gap to fp32 state (same
    weights, data order and seed), mean and spread over seeds."""
    for weights in ("fp32", "bf16"):
        ref = [adam_run("fp32", weights, seed=s) for s in seeds]
        for state in ("fp32", "uint8-e4m4", "uint8-e4m4-sqrt", "int8-linear", "int8-linear-sqrt"):
            res = ref if state == "fp32" else [adam_run(state, weights, seed=s) for s in seeds]
            for k, what in enumerate(("train(last 20)", "held-out")):
                gap = torch.tensor([r[k] - f[k] for r, f in zip(res, ref)])
                ok = gap.isfinite()
                print(f"weights {weights} state {state:17} {what:14} mean {torch.tensor([r[k] for r in res])[ok].mean():.4f} "
                      f"gap to fp32 state {gap[ok].mean():+.4f} (std {gap[ok].std():.4f}); NaN in {int((~ok).sum())}/{len(gap)} seeds")


if __name__ == "__main__":
    torch.set_num_threads(1)
    what = sys.argv[1:] or ["remainder", "adam"]
    if "remainder" in what:
        remainder_runs()
        remainder_wide_runs()
    if "adam" in what:
        adam_runs()
