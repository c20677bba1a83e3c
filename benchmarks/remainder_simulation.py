"""A simulation of O5's fp32 masters against masters kept only as (w, r) (bf16 weight + int16
remainder), stepped side by side on the same data: which encodings keep O5's masters bit for bit.
Used by tests/kernels/test_remainder.py and benchmarks/frontier_kernels_experiments.py."""
import torch

from ampkit._kernels.remainder import combine, master, remainder, side_table, split_

def split_losing_ties(ws, rs, xs):
    """The plain saturating encoding, for comparison: r = clamp(d), so d = +32768 is lost."""
    for w, r, x in zip(ws, rs, xs):
        w.copy_(x)
        r.copy_((x.view(torch.int32) - w.view(torch.int16).to(torch.int32).bitwise_left_shift(16)).clamp_(-32768, 32767))


def combine_losing_ties(ws, rs, outs):
    for w, r, out in zip(ws, rs, outs):
        out.view(torch.int32).copy_(w.view(torch.int16).to(torch.int32).bitwise_left_shift(16) + r)


def split_without_table(ws, rs, xs):
    """The 16 bits alone (as before side tables): split into scratch, keep only the codes."""
    scratch = [torch.empty_like(r) for r in rs]
    split_(ws, scratch, xs)
    for r, code in zip(rs, scratch):
        r.copy_(code)


ENCODINGS = {"remainder": (split_, combine), "without_table": (split_without_table, combine),
             "losing_ties": (split_losing_ties, combine_losing_ties)}
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=2**-8, eps=2**-40, weight_decay=2**-4),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=2**-6, momentum=0.5),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=2**-5, eps=2**-40),
}


def dyadic(shape, g, low=-2, high=1):
    """Random +-2**k, k in [low, high): data whose products and sums land on rounding ties."""
    sign = torch.randint(0, 2, shape, generator=g).mul(2).sub(1)
    return sign * torch.pow(2.0, torch.randint(low, high, shape, generator=g).float())


def loss_and_grads(ws, data):
    """An MLP's mean squared error, computed by the bfloat16 model ``ws``, and its gradients."""
    x, y = data
    leaves = [w.detach().requires_grad_() for w in ws]
    h = torch.nn.functional.linear(x, leaves[0], leaves[1]).relu()
    loss = torch.nn.functional.mse_loss(torch.nn.functional.linear(h, leaves[2], leaves[3]).float(), y)
    loss.backward()
    return loss.detach(), [p.grad.float() for p in leaves]


def ulps(x: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest ``|x - ref|`` in float32 ULPs of ``ref`` (of the least normal at zero)."""
    _, e = torch.frexp(ref)
    return ((x.double() - ref.double()).abs() / torch.ldexp(torch.ones_like(ref, dtype=torch.float64), e.clamp(min=-125) - 24)).max().item()


def low17(ts, value: int) -> int:
    """How many of the float32 ``ts`` have low 17 bits ``value`` (NaN not counted)."""
    return sum(int((t.view(torch.int32).bitwise_and(0x1FFFF).eq(value) & ~t.isnan()).sum()) for t in ts)


def simulate(optimizer: str, encoding: str, steps: int = 200, seed: int = 0, data=dyadic, hidden: int = 64) -> dict:
    """Train O5-style (fp32 masters, model = master.to(bf16)) and with masters kept only as
    (w, r) (combine, the same fp32 step, split) side by side on the same data. Counted over
    the steps: ``ties`` (masters on a rounding tie), ``ties_above_even`` (d = +32768) and
    ``plus_ones`` (d = +32767 above an even w) of the (w, r) run's masters before each split,
    ``o5_plus_ones`` the same of O5's masters, ``listed`` the side tables' entries after each
    split, ``lost`` the masters that did not come back exactly."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(hidden, 16), (hidden,), (8, hidden), (8,)]
    init = [(torch.randn(s, generator=g) / (s[-1] if len(s) == 2 else 16) ** 0.5).bfloat16().float() for s in shapes]
    batch = (data((32, 16), g).bfloat16(), data((32, 8), g))
    split, comb = ENCODINGS[encoding]
    masters, xs = [t.clone() for t in init], [t.clone() for t in init]
    ws, rs = [t.bfloat16() for t in init], [torch.zeros_like(t, dtype=torch.int16) for t in init]
    opt_a, opt_b = OPTIMIZERS[optimizer](masters), OPTIMIZERS[optimizer](xs)
    split(ws, rs, xs)
    out = dict.fromkeys(["ties", "ties_above_even", "plus_ones", "o5_plus_ones", "listed", "lost", "model_differs",
                         "loss_differs", "max_master_ulps"], 0)
    out.update(losses=None, first_model_difference=None)  # the last step's (O5, (w, r)) losses
    for step in range(steps):
        loss_a, grads = loss_and_grads([m.bfloat16() for m in masters], batch)
        for m, gr in zip(masters, grads):
            m.grad = gr
        opt_a.step()
        comb(ws, rs, xs)
        loss_b, grads = loss_and_grads(ws, batch)
        for x, gr in zip(xs, grads):
            x.grad = gr
        opt_b.step()
        with torch.no_grad():
            bits = [x.view(torch.int32).clone() for x in xs]
            out["ties"] += sum(b.bitwise_and(0xFFFF).eq(0x8000).sum().item() for b in bits)
            out["ties_above_even"] += low17(xs, 0x08000)
            out["plus_ones"] += low17(xs, 0x07FFF)
            out["o5_plus_ones"] += low17(masters, 0x07FFF)
            split(ws, rs, xs)
            out["listed"] += sum(side_table(r).numel() for r in rs)
            comb(ws, rs, xs)
            out["lost"] += sum(x.view(torch.int32).ne(b).sum().item() for x, b in zip(xs, bits))
            out["max_master_ulps"] = max([out["max_master_ulps"]] + [ulps(x, m) for x, m in zip(xs, masters)])
            same = all(torch.equal(w.view(torch.int16), m.bfloat16().view(torch.int16)) for w, m in zip(ws, masters))
            for x in xs:
                x.fill_(float("nan"))  # between steps the master lives only in (w, r)
        out["loss_differs"] += int(not torch.equal(loss_a.view(torch.int32), loss_b.view(torch.int32)))
        out["losses"] = (loss_a.item(), loss_b.item())
        out["model_differs"] += int(not same)
        if not same and out["first_model_difference"] is None:
            out["first_model_difference"] = step
    return out
