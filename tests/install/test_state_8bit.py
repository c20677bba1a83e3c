"""O8 / optimizer_state_dtype="8bit": the optimizer's elementwise state kept in 8 bits between
steps (codes and per-block scales), widened to float32 for each step.

Checked: training with each kind of torch optimizer against O7, the stored layout, unbiased
rounding of the stored state, skipped steps, chunking, and bit-exact resume.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit.core.blockquant import dequantize, num_blocks
from ampkit.core.registry import current as current_run
from ampkit.install import state_8bit, transient_update

from .test_transient_update import train

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, centered=True),
}
KEYS = {  # each optimizer's elementwise state, and its code
    "adamw": {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8},
    "adam": {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8, "max_exp_avg_sq": torch.uint8},
    "sgd": {"momentum_buffer": torch.int8},
    "adagrad": {"sum": torch.uint8},
    "rmsprop": {"square_avg": torch.uint8, "grad_avg": torch.int8},
}


def make_model(bn: bool = False):
    torch.manual_seed(0)
    layers = [nn.Linear(8, 64), nn.Tanh()] + ([nn.BatchNorm1d(64)] if bn else []) + [nn.Linear(64, 4)]
    return nn.Sequential(*layers)


def batches(n):
    """A learnable task: targets from a fixed random teacher, plus noise."""
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(8, 4, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(32, 8, generator=g)
        out.append((x, torch.tanh(x @ teacher) + 0.05 * torch.randn(32, 4, generator=g)))
    return out


def build(level="O8", opt_name="adamw", bn=False, **kw):
    model = make_model(bn)
    return ampkit.initialize(model, OPTIMIZERS[opt_name](model.parameters()), opt_level=level, verbosity=0, **kw)


def raw_state(opt):
    """Every tensor of ``optimizer.state`` as stored (codes and scales at O8), cloned."""
    return {(i, k): v.clone() for i, p in enumerate(p for g in opt.param_groups for p in g["params"])
            for k, v in opt.state[p].items()}


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_trains_like_o7_with_the_state_in_8_bits(opt_name):
    data = batches(60)
    model, opt = build(opt_name=opt_name, bn=True)
    losses = train(model, opt, data)
    ref, ref_opt = build("O7", opt_name, bn=True)
    ref_losses = train(ref, ref_opt, data)
    final, ref_final = sum(losses[-10:]) / 10, sum(ref_losses[-10:]) / 10
    assert final < 0.4 * sum(losses[:5]) / 5  # it learns
    assert abs(final - ref_final) <= 0.02 * ref_final  # as well as O7 (measured: within 0.4%)
    batchnorm = {id(model[2].weight), id(model[2].bias)}
    for p in model.parameters():
        state = opt.state[p]
        if id(p) in batchnorm:  # float32 parameters keep float32 state
            assert p.dtype == torch.float32 and {state[k].dtype for k in KEYS[opt_name]} == {torch.float32}
            continue
        assert p.dtype == torch.bfloat16
        expected = {k + sfx for k in KEYS[opt_name] for sfx in (state_8bit.CODES, state_8bit.SCALES)}
        assert expected <= set(state) and not set(KEYS[opt_name]) & set(state)
        for k, code in KEYS[opt_name].items():
            codes, scales = state[k + state_8bit.CODES], state[k + state_8bit.SCALES]
            assert (codes.dtype, codes.shape) == (code, p.shape)
            assert (scales.dtype, scales.shape) == (torch.float32, (num_blocks(p.numel()),))
            assert torch.isfinite(scales).all() and torch.equal(torch.frexp(scales[scales > 0])[0], torch.full_like(scales[scales > 0], 0.5))


def test_state_dict_holds_the_state_widened_and_loads_into_o7():
    data = batches(3)
    model, opt = build()
    train(model, opt, data)
    sd = opt.state_dict()
    for i, p in enumerate(model.parameters()):
        st = sd["state"][i]
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
        codes, scales = opt.state[p]["exp_avg" + state_8bit.CODES], opt.state[p]["exp_avg" + state_8bit.SCALES]
        assert st["exp_avg"].dtype == torch.float32 and st["exp_avg"].shape == p.shape
        assert torch.equal(st["exp_avg"].view(-1), dequantize(codes.view(-1), scales, torch.empty(p.numel())))
    o7, o7_opt = build("O7")  # the same format as O7's (and plain torch's) state
    o7_opt.load_state_dict(copy.deepcopy(sd))
    for i, q in enumerate(o7.parameters()):
        assert all(torch.equal(o7_opt.state[q][k], v) and o7_opt.state[q][k].dtype == v.dtype for k, v in sd["state"][i].items())


def _dot_model(n):
    class Dot(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(n))

        def forward(self, x):
            return (self.w * x).sum()
    return Dot()


def train_on(model, opt, x):
    opt.zero_grad()
    with ampkit.scale_loss(model(x), opt) as scaled:
        scaled.backward()
    opt.step()


def _neighbours(x: torch.Tensor, scales: torch.Tensor, code: torch.dtype):
    """The codes' values just below and above ``|x|`` (flat float64), from the block scales."""
    s = scales.double().repeat_interleave(256)[:x.numel()]
    y = x.abs() / s
    if code == torch.int8:
        step = torch.ones_like(y)
    else:  # e4m4: 4 mantissa bits in each binade at or above 2**-14, then steps of 2**-18
        _, e = torch.frexp(y)
        step = torch.where(y >= 2.0 ** -14, torch.ldexp(torch.ones_like(y), e - 5), torch.full_like(y, 2.0 ** -18))
    lo = torch.floor(y / step) * step
    return lo * s, (lo + step) * s


@pytest.mark.parametrize("opt_name,key,value", [
    ("sgd", "momentum_buffer", lambda c: c),  # the first step's momentum is the gradient: int8
    ("adagrad", "sum", lambda c: c.abs()),  # its sum is the squared gradient, stored as its root: uint8
])
def test_stored_state_is_unbiased(opt_name, key, value):
    """One step under each of 1000 rounding seeds: the stored (dequantized) state averages to its float32
    value within 5 sigma, element by element, and is always one of its two neighbours."""
    n, trials = 600, 1000
    g = torch.Generator().manual_seed(3)
    c = (torch.rand(n, generator=g) * 2 - 1).to(torch.bfloat16).float()  # exact in bf16: the gradient is c
    c[:256] *= 2.0 ** -20  # a block of small values gets its own fine scale
    c[300] = 1.0  # and a grid value
    model = _dot_model(n)
    model, opt = ampkit.initialize(model, OPTIMIZERS[opt_name]([model.w]), opt_level="O8", verbosity=0)
    code, samples, scales = state_8bit.code_dtype(key), [], None
    for seed in range(trials):
        with torch.no_grad():
            model.w.zero_()
        opt.state.clear()
        ampkit.stochastic_rounding.manual_seed(seed, optimizer=opt)
        train_on(model, opt, c)
        st = opt.state[model.w]
        codes, scales = st[key + state_8bit.CODES], st[key + state_8bit.SCALES]
        samples.append(dequantize(codes.view(-1), scales, torch.empty(n)).double())
    stored = torch.stack(samples)
    x = value(c).double()
    lo, hi = _neighbours(x, scales, code)
    mag = stored.abs()
    assert ((mag == lo) | (mag == hi)).all() and (stored * x >= 0).all()
    p = (x.abs() - lo) / (hi - lo)
    sigma = (hi - lo) * torch.sqrt(p * (1 - p) / trials)
    assert ((stored.mean(0) - x).abs() <= 5 * sigma + 1e-300).all()
    assert ((p > 0.05) & (p < 0.95)).sum() > n // 4  # most elements do round: the test has teeth
    assert torch.equal(stored[:, 300], torch.full((trials,), 1.0, dtype=torch.float64))


def test_overflow_skip_leaves_codes_scales_weights_and_generators_untouched():
    model, opt = build()
    train(model, opt, batches(2))
    weights = [p.detach().clone() for p in model.parameters()]
    state = raw_state(opt)
    rng = current_run("test").rounding.state_dict()
    x, y = batches(1)[0]
    opt.zero_grad()
    with ampkit.scale_loss(F.mse_loss(model(x), y) * float("inf"), opt) as scaled:
        scaled.backward()
    opt.step()
    assert current_run("test").scalers[0].skipped_steps == 1 and ampkit.step_was_skipped(opt)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    after = raw_state(opt)
    assert after.keys() == state.keys() and all(torch.equal(state[k], after[k]) and state[k].dtype == after[k].dtype for k in state)
    assert torch.equal(rng["generators"]["cpu"], current_run("test").rounding.state_dict()["generators"]["cpu"])
    train(model, opt, batches(1))  # the next clean step moves on
    assert any(not torch.equal(state[k], v) for k, v in raw_state(opt).items())


def test_chunked_step_equals_one_chunk(monkeypatch):
    """Rounded to nearest the weights draw nothing, and SGD's one state (int8) draws its codes
    in parameter order, from block-aligned offsets, chunked or not (the CPU generator's stream
    runs on across calls): the same weights and the same stored state."""
    data = batches(3)
    model, opt = build(opt_name="sgd", bn=True, update_rounding="nearest")
    train(model, opt, data)
    monkeypatch.setattr(transient_update, "CHUNK_ELEMENTS", 300)
    small, small_opt = build(opt_name="sgd", bn=True, update_rounding="nearest")
    inner, calls = small_opt._ampkit._step.step, []
    small_opt._ampkit._step.step = lambda: calls.append(1) or inner()
    train(small, small_opt, data)
    assert len(calls) == 3 * 3  # per step: [fc1.weight 512, the BatchNorm], [fc1.bias 64], [fc2.weight 256, fc2.bias 4]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), small.parameters()))
    mine, theirs = raw_state(opt), raw_state(small_opt)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def _same_state_dicts(a: dict, b: dict) -> bool:
    return a["state"].keys() == b["state"].keys() and all(
        a["state"][i].keys() == b["state"][i].keys()
        and all(torch.equal(a["state"][i][k], b["state"][i][k]) for k in a["state"][i]) for i in a["state"])


@pytest.mark.parametrize("how", ["state_dicts", "checkpoint"])
def test_resume_is_bit_exact(tmp_path, how):
    """N steps, save, M more; against a fresh model and optimizer loaded from the save
    running the same M steps: identical losses, bf16 weights and state, bit for bit."""
    data = batches(8)
    first, first_opt = build()
    train(first, first_opt, data[:4])
    path = tmp_path / "ckpt.pt"
    if how == "checkpoint":
        ampkit.checkpoint.save(path, first, first_opt)
    else:
        torch.save({"model": first.state_dict(), "optimizer": first_opt.state_dict(),
                    "amp": ampkit.state_dict(optimizer=first_opt)}, path)
    saved = copy.deepcopy(first_opt.state_dict())  # its step counters are the live ones
    losses = train(first, first_opt, data[4:])

    second, second_opt = build()
    if how == "checkpoint":
        ampkit.checkpoint.load(path, second, second_opt)
    else:
        ckpt = torch.load(path)
        second.load_state_dict(ckpt["model"])
        second_opt.load_state_dict(ckpt["optimizer"])
        ampkit.load_state_dict(ckpt["amp"], optimizer=second_opt)
    assert _same_state_dicts(saved, second_opt.state_dict())  # the loaded codes hold the saved values exactly
    assert all(k.endswith((state_8bit.CODES, state_8bit.SCALES)) or k == "step" for st in second_opt.state.values() for k in st)
    assert train(second, second_opt, data[4:]) == losses
    assert all(torch.equal(p, q) and q.dtype == torch.bfloat16 for p, q in zip(first.parameters(), second.parameters()))
    assert _same_state_dicts(first_opt.state_dict(), second_opt.state_dict())


@pytest.mark.parametrize("level,overrides", [
    ("O5", dict(optimizer_state_dtype="8bit")),
    ("O8", dict(master_weights=True)),
    ("O8", dict(update_rounding=False)),
])
def test_8bit_without_the_transient_update_is_refused_before_anything_changes(level, overrides):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"initialize\(optimizer_state_dtype='8bit'\): 8-bit optimizer state needs"):
        ampkit.initialize(model, opt, opt_level=level, verbosity=0, **overrides)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert getattr(opt, "_ampkit", None) is None and getattr(model, "_ampkit", None) is None


def test_loading_fp32_state_quantizes_it_without_the_runs_generators():
    """O7's float32 state loads into O8: stored in 8 bits, each value within one code of its
    own, and the run's rounding generators do not move (so a resume does not depend on
    whether the optimizer or the amp state is loaded first)."""
    o7, o7_opt = build("O7")
    train(o7, o7_opt, batches(3))
    sd = copy.deepcopy(o7_opt.state_dict())
    model, opt = build()
    train(model, opt, batches(1))  # the run's generator has drawn
    rng = opt._ampkit.run.rounding.state_dict()["generators"]["cpu"]
    opt.load_state_dict(sd)
    assert torch.equal(rng, opt._ampkit.run.rounding.state_dict()["generators"]["cpu"])
    loaded = opt.state_dict()["state"]
    for i, p in enumerate(model.parameters()):
        assert set(opt.state[p]) == {"step"} | {k + sfx for k in ("exp_avg", "exp_avg_sq") for sfx in (state_8bit.CODES, state_8bit.SCALES)}
        scales = opt.state[p]["exp_avg" + state_8bit.SCALES].repeat_interleave(256)[:p.numel()].view(p.shape)
        assert ((loaded[i]["exp_avg"] - sd["state"][i]["exp_avg"]).abs() <= scales).all()
        root, ref = loaded[i]["exp_avg_sq"].sqrt(), sd["state"][i]["exp_avg_sq"].sqrt()
        assert ((root - ref).abs() <= ref / 16 + 2.0 ** -18 * opt.state[p]["exp_avg_sq" + state_8bit.SCALES].max()).all()
    train(model, opt, batches(2))  # and it trains on
