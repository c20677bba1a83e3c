"""O8's fused AdamW and SGD: they store what ``state_8bit`` packs from their arithmetic, the
kernel and the eager reference agree bit for bit through training (skipped steps, resume,
odd sizes, a non-contiguous parameter), chunks with a non-finite weight write nothing on
either path, and the per-element Adam bound holds."""
import copy

import pytest
import torch
from torch import nn

import ampkit
from ampkit._kernels import blockquant, fused_sgd, native
from ampkit._kernels.fused_adamw import Hyper, arithmetic
from ampkit._run.registry import current as current_run
from ampkit._kernels.rounding import StochasticRounder, round_counter_
from ampkit._update import chunks, fused_sgd_update, fused_sgd_update_8bit, fused_update_8bit, state_8bit
from tests.update.test_fused_update import ADAMS, batches, make_model, train
from tests.update.test_state_8bit import (_dot_model, adam_constant, adam_state_bound, assert_state_within_bounds,
                                           one_large_gradient_per_block, raw_state, train_on)


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().view(-1)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def o8(adam="adamw", model=None):
    model = model or make_model()
    opt = ADAMS[adam](model.parameters())
    return ampkit.initialize(model, opt, opt_level="O8", verbosity=0)


def calls_of_own_step(opt) -> list:
    """Count the optimizer's own step calls (the eager path's)."""
    update, calls = opt._ampkit.update, []
    inner = update.own_step
    update.own_step = lambda: calls.append(1) or inner()
    return calls


def spanning_decades(n: int, decades: int, seed: int = 3) -> torch.Tensor:
    """Gradients of either sign spanning ``decades`` decades (so the first moments' cap binds)."""
    g = torch.Generator().manual_seed(seed)
    sign = torch.randint(0, 2, (n,), generator=g) * 2.0 - 1
    return (sign * 10 ** (-decades * torch.rand(n, generator=g))).to(torch.bfloat16).float()


@pytest.mark.parametrize("adam", ["adamw", "adam"])
def test_the_fused_path_stores_what_state_8bit_packs(lib, monkeypatch, adam):
    """Three steps of a 1000-element parameter (gradients spanning 30 decades: the first
    moments' cap binds); the third again from the state before it,
    widened by ``state_8bit``, stepped by ``fused_adamw.arithmetic``, the weight rounded with
    stream 0 and the state packed by ``state_8bit.pack`` with the run's seed and step: the
    fused step's weight, codes and scales, bit for bit."""
    model, opt = o8(adam, _dot_model(1000))
    x = spanning_decades(1000, 30)
    for _ in range(2):
        train_on(model, opt, x)
    p, group = model.w, opt.param_groups[0]
    st, w = {k: v.clone() for k, v in opt.state[p].items()}, p.detach().clone()
    seed, step = current_run("test").rounder.seed, current_run("test").rounder.step
    seen, calls, inner = {}, calls_of_own_step(opt), fused_update_8bit.step
    monkeypatch.setattr(fused_update_8bit, "step", lambda o, chunk, grads, *a: seen.update(grads) or inner(o, chunk, grads, *a))
    train_on(model, opt, x)
    assert not calls and p in seen  # the fused path stepped, the optimizer's own step was not called

    state_8bit.widen(state_8bit.held({p: st}, [p]))
    st["step"] += 1
    b1, b2 = group["betas"]
    hyper = Hyper(group["lr"], b1, b2, group["eps"], group["weight_decay"], adam == "adamw", adam == "adam",
                  st["step"].item())
    new_w, st["exp_avg"], st["exp_avg_sq"] = arithmetic(w, seen[p], st["exp_avg"], st["exp_avg_sq"], hyper)
    round_counter_(w, new_w, seed, step, 0, 0, 0)
    rounder = StochasticRounder(seed)
    rounder.step = step
    state_8bit.pack([(st, p)], {}, opt, rounder, {p: 0})
    assert torch.equal(bits(w), bits(p.detach())) and st.keys() == opt.state[p].keys()
    assert all(torch.equal(bits(st[k]), bits(opt.state[p][k])) for k in st)


def snapshot(model, opt):
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(raw_state(opt))


def same(a, b) -> bool:
    (wa, sa), (wb, sb) = a, b
    return (all(torch.equal(bits(x), bits(y)) for x, y in zip(wa, wb)) and sa.keys() == sb.keys()
            and all(torch.equal(bits(sa[k]), bits(sb[k])) for k in sa))


def saved_trained_and_resumed(model, opt, data, path, build) -> tuple:
    """Save the run (model, optimizer, ampkit state) to ``path``, train it on ``data``, and load
    the save into ``build()``'s fresh run, trained on ``data`` too: the snapshots at the save,
    of the run and of the resumed run. The loaded state holds the saved values bit for bit (a
    block's scale may differ: its codes with it)."""
    saved = copy.deepcopy(opt.state_dict()["state"])  # its step counters are the live ones
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": ampkit.state_dict(optimizer=opt)}, path)
    middle = snapshot(model, opt)
    train(model, opt, data)
    resumed, resumed_opt = build()
    ckpt = torch.load(path)
    resumed.load_state_dict(ckpt["model"])
    resumed_opt.load_state_dict(ckpt["optimizer"])
    ampkit.load_state_dict(ckpt["amp"], optimizer=resumed_opt)
    loaded = resumed_opt.state_dict()["state"]
    assert all(torch.equal(bits(v), bits(loaded[i][k])) for i, st in saved.items() for k, v in st.items())
    train(resumed, resumed_opt, data)
    return middle, snapshot(model, opt), snapshot(resumed, resumed_opt)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")  # a zero-size layer, on purpose
@pytest.mark.parametrize("adam", ["adamw", "adam"])
def test_training_with_the_kernel_equals_the_eager_reference(lib, monkeypatch, tmp_path, adam):
    """Four steps with an overflowing one (skipped), saved, then two more after a load into a
    fresh run: kernel and eager reference agree bit for bit at each point (odd sizes, an empty
    layer, a non-contiguous parameter), and the resumed run equals the uninterrupted one."""
    data = batches(6)
    runs = {}
    for kind in ("kernel", "eager"):
        monkeypatch.setattr(native, "_state", {} if kind == "kernel" else {"lib": None})
        model, opt = o8(adam)
        calls = calls_of_own_step(opt)
        assert all(fused_update_8bit.eligible(opt, opt.param_groups[0], p, p.detach()) for p in model.parameters())
        train(model, opt, data[:4], poison=(1,))
        assert not calls and current_run("t").scalers[0].skipped_steps == 1 and current_run("t").rounder.step == 3
        runs[kind] = saved_trained_and_resumed(model, opt, data[4:], tmp_path / f"{kind}.pt", lambda: o8(adam))
        assert same(runs[kind][1], runs[kind][2])
        state = opt.state[model.a.weight]
        assert state["exp_avg.codes"].dtype == torch.int8 and state["exp_avg_sq.codes"].dtype == torch.uint8
        assert state["step"].item() == 5.0
    assert all(same(a, b) for a, b in zip(runs["kernel"], runs["eager"]))
    assert not same(runs["kernel"][0], runs["kernel"][1])


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")  # a zero-size layer, on purpose
@pytest.mark.parametrize("adam", ["adamw", "adam"])
def test_chunks_the_kernel_cannot_take_step_in_its_arithmetic(lib, monkeypatch, adam):
    """Parameters the kernel does not take (FSDP2 shards cutting blocks, here every parameter
    by a patched rule) step in the chunks with ampkit's arithmetic, not the optimizer's own
    step (never called): bit for bit the kernel's run, through a skipped step (so 1 and N ranks
    agree)."""
    data = batches(5)
    runs = {}
    for kind in ("kernel", "chunks"):
        if kind == "chunks":
            monkeypatch.setattr(fused_update_8bit, "whole_blocks", lambda p, block: False)
        model, opt = o8(adam)
        calls = calls_of_own_step(opt)
        train(model, opt, data, poison=(1,))
        assert not calls and current_run("t").scalers[0].skipped_steps == 1
        runs[kind] = snapshot(model, opt)
    assert same(runs["kernel"], runs["chunks"])


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")  # a zero-size layer, on purpose
def test_ampkit_fused_0_keeps_the_optimizers_own_step(monkeypatch):
    """``AMPKIT_FUSED=0``, and a group the kernel does not do (amsgrad): the optimizer's own step."""
    monkeypatch.setenv("AMPKIT_FUSED", "0")
    model, opt = o8()
    calls = calls_of_own_step(opt)
    train(model, opt, batches(1))
    assert calls
    monkeypatch.delenv("AMPKIT_FUSED")
    model = make_model()
    model, opt = ampkit.initialize(model, torch.optim.AdamW(model.parameters(), amsgrad=True), opt_level="O8", verbosity=0)
    calls = calls_of_own_step(opt)
    train(model, opt, batches(1))
    assert calls and "max_exp_avg_sq.codes" in opt.state[model.a.weight]


class _Three(nn.Module):
    """Three bf16 weight vectors of ``n`` elements; the loss is linear in them."""

    def __init__(self, n, start: dict):
        super().__init__()
        self.w, self.u, self.v = (nn.Parameter(torch.full((n,), start.get(k, 1.0))) for k in "wuv")

    def forward(self, x):
        return ((self.w + self.u + self.v) * x).sum()


@pytest.mark.parametrize("where", ["w", "u"])
def test_a_chunk_with_a_non_finite_weight_writes_nothing_on_either_path(monkeypatch, where):
    """Two chunks (``CHUNK_ELEMENTS`` made 1200): the first holds ``w`` (fused path) and ``u``
    (an amsgrad group: the eager path), the second ``v``. After a first step, a learning rate
    of 3e37 up (maximize) on the one at bfloat16's top makes its weight infinite, on the
    fused path (``w``) or the eager one (``u``): the whole first chunk writes nothing (weights,
    codes, scales, step counts), ``v`` steps, and the step is reported skipped."""
    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 1200)
    model = _Three(600, {where: 3.3e38})
    opt = torch.optim.Adam([{"params": [model.w], "maximize": where == "w"},
                            {"params": [model.u], "amsgrad": True, "maximize": where == "u"}, {"params": [model.v]}], lr=1e-3)
    model, opt = ampkit.initialize(model, opt, opt_level="O8", verbosity=0)
    calls, x = calls_of_own_step(opt), torch.ones(600)
    train_on(model, opt, x)
    assert not ampkit.step_was_skipped(opt) and len(calls) == 1  # u only
    assert fused_update_8bit.eligible(opt, opt.param_groups[0], model.w, model.w.detach())
    opt.param_groups[0 if where == "w" else 1]["lr"] = 3e37
    weights, state = [p.detach().clone() for p in model.parameters()], raw_state(opt)
    train_on(model, opt, x)
    assert ampkit.step_was_skipped(opt)
    moved = {n for (n, p), w in zip(model.named_parameters(), weights) if not torch.equal(bits(p), bits(w))}
    after = raw_state(opt)
    assert moved == {"v"} and after.keys() == state.keys()
    assert all(torch.equal(bits(state[k]), bits(after[k])) for k in state if k[0] != 2)
    assert after[(2, "step")] == state[(2, "step")] + 1 and not torch.equal(state[(2, "exp_avg.codes")], after[(2, "exp_avg.codes")])
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("first_step", [True, False])
def test_a_non_finite_weight_mid_chunk_puts_back_every_fused_tensor(lib, first_step):
    """Three fused tensors in one chunk, one group each (the op runs per group): the middle one's
    weight goes infinite, so the first one has written, the middle one writes nothing and the
    last one never steps. The whole chunk is put back: weights, codes, scales and step counts
    keep their bits, and on a first step no state is left behind; the next step goes on."""
    model = _Three(600, {"u": 3.3e38})
    opt = torch.optim.Adam([{"params": [model.w]}, {"params": [model.u], "maximize": True}, {"params": [model.v]}],
                           lr=1e-3)
    model, opt = ampkit.initialize(model, opt, opt_level="O8", verbosity=0)
    calls, x = calls_of_own_step(opt), torch.ones(600)
    if not first_step:
        train_on(model, opt, x)
        assert not ampkit.step_was_skipped(opt) and sum(map(bool, opt.state.values())) == 3
    opt.param_groups[1]["lr"] = 3e37
    weights, state = [p.detach().clone() for p in model.parameters()], copy.deepcopy(raw_state(opt))
    train_on(model, opt, x)
    assert ampkit.step_was_skipped(opt) and not calls  # all three fused, none through the optimizer's own step
    assert all(torch.equal(bits(p), bits(w)) for p, w in zip(model.parameters(), weights))
    after = raw_state(opt)
    assert after.keys() == state.keys() and all(torch.equal(bits(state[k]), bits(after[k])) for k in state)
    assert sum(map(bool, opt.state.values())) == (0 if first_step else 3)  # raw_state's lookups add empty entries
    opt.param_groups[1]["lr"] = 1e-3
    train_on(model, opt, x)
    assert not ampkit.step_was_skipped(opt) and all(torch.isfinite(p).all() for p in model.parameters())
    assert [int(opt.state[p]["step"]) for p in model.parameters()] == [1 if first_step else 2] * 3


@pytest.mark.parametrize("case", ["one_large_per_block", "decades"])
def test_the_adam_bound_holds_per_element_on_the_fused_path(lib, case):
    """AdamW, lr 1e-3, 60 steps of the issue's case (as in test_state_8bit, there on the eager
    path: each 256-block with one gradient of 1 and 255 of 1e-6), or of gradients spanning 36
    decades that change every step (the cap binds). Each weight moves at most exact Adam's
    largest step, ``lr * 7.27``, plus the stochastic rounding to bfloat16 (under one bf16
    step of the larger of the two weights); the stored state stays within its cap."""
    lr, wd = 1e-3, 0.01
    model, opt, x = one_large_gradient_per_block(lr=lr, weight_decay=wd)
    n = x.numel()
    calls = calls_of_own_step(opt)
    for t in range(60):
        before = model.w.detach().double()
        train_on(model, opt, x if case == "one_large_per_block" else spanning_decades(n, 36, seed=t))
        after = model.w.detach().double()
        ulp = 2.0 ** -7 * torch.maximum(before.abs(), after.abs()) + 2.0 ** -133
        assert ((after - before * (1 - lr * wd)).abs() <= lr * adam_constant(0.9, 0.999) * (1 + 1e-5) + ulp).all()
        assert_state_within_bounds(opt, lambda k: adam_state_bound(0.9, 0.999, k))
    assert not calls and model.w.abs().max() <= 60 * lr * adam_constant(0.9, 0.999) * 1.01


def checkpoint_from_the_layout(model, opt, step: int) -> dict:
    """A checkpoint as O8 saved it before its counter draws changed (the format did not): the
    state widened from hand-made codes and power-of-two scales (``state_8bit``'s layout), the
    run's seed and step."""
    g = torch.Generator().manual_seed(5)
    state = {}
    for i, p in enumerate(model.parameters()):
        n, blocks = p.numel(), blockquant.num_blocks(p.numel())
        mq = torch.randint(-127, 128, (n,), dtype=torch.int8, generator=g)
        vq = torch.randint(16, 254, (n,), dtype=torch.uint8, generator=g)
        ms, vs = (2.0 ** torch.randint(lo, lo + 4, (blocks,), generator=g).float() for lo in (-40, -8))  # |m| far below the cap
        m, r = (blockquant.dequantize(q, s, torch.empty(n)).view(p.shape) for q, s in ((mq, ms), (vq, vs)))
        state[i] = {"step": torch.tensor(float(step)), "exp_avg": m, "exp_avg_sq": r.square()}
    saved = opt.state_dict()
    amp = ampkit.state_dict(optimizer=opt)
    amp["stochastic_rounding"] = {"seed": 3, "step": step}
    return {"model": model.state_dict(), "optimizer": {**saved, "state": state}, "amp": amp}


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")  # a zero-size layer, on purpose
def test_a_checkpoint_saved_before_the_draws_changed_resumes(lib, monkeypatch):
    """Loading gives back the saved values exactly (no draws), and the next steps run
    from them: kernel and eager reference bit for bit, weights finite and moved."""
    runs = []
    for kind in ("kernel", "eager"):
        monkeypatch.setattr(native, "_state", {} if kind == "kernel" else {"lib": None})
        model, opt = o8()
        ckpt = checkpoint_from_the_layout(model, opt, 7)
        opt.load_state_dict(ckpt["optimizer"])
        ampkit.load_state_dict(ckpt["amp"], optimizer=opt)
        loaded = opt.state_dict()["state"]  # the values (a block's scale may differ: its codes with it)
        assert all(torch.equal(bits(v), bits(loaded[i][k])) for i, st in ckpt["optimizer"]["state"].items()
                   for k, v in st.items())
        before = [p.detach().clone() for p in model.parameters()]
        train(model, opt, batches(2))
        assert current_run("t").rounder.step == 9 and opt.state[model.a.weight]["step"].item() == 9.0
        assert all(bool(p.isfinite().all()) for p in model.parameters())
        assert not torch.equal(before[1], model.a.weight.detach())
        runs.append(snapshot(model, opt))
    assert same(*runs)


SGDS = {"momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=5e-4),
        "nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True, maximize=True),
        "dampening": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.7, dampening=0.25, weight_decay=1e-2)}


def o8_sgd(kind, model=None):
    model = model or make_model()
    return ampkit.initialize(model, SGDS[kind](model.parameters()), opt_level="O8", verbosity=0)


@pytest.mark.parametrize("kind", list(SGDS))
def test_sgd_steps_in_its_kernel_and_stores_what_state_8bit_packs(lib, monkeypatch, kind):
    """Three SGD steps of a 1000-element parameter; the third again from the state before it,
    widened by ``state_8bit``, stepped by ``fused_sgd.arithmetic``, the weight rounded with
    SGD's paired bits and the buffer packed by ``state_8bit.pack``: the fused step's weight, codes and
    scales, bit for bit (the first step made the buffer as torch's does)."""
    model, opt = o8_sgd(kind, _dot_model(1000))
    x = spanning_decades(1000, 6)
    seen, calls, inner = {}, calls_of_own_step(opt), fused_sgd_update_8bit.step
    monkeypatch.setattr(fused_sgd_update_8bit, "step", lambda o, chunk, grads, *a: seen.update(grads) or inner(o, chunk, grads, *a))
    for _ in range(2):
        train_on(model, opt, x)
    p = model.w
    st, w = {k: v.clone() for k, v in opt.state[p].items()}, p.detach().clone()
    assert set(st) == {"momentum_buffer.codes", "momentum_buffer.scales"} and st["momentum_buffer.codes"].dtype == torch.int8
    seed, step = current_run("test").rounder.seed, current_run("test").rounder.step
    train_on(model, opt, x)
    assert not calls and p in seen

    state_8bit.widen(state_8bit.held({p: st}, [p]))
    new_w, st["momentum_buffer"] = fused_sgd.arithmetic(w, seen[p], st["momentum_buffer"],
                                                        fused_sgd_update.hyper(opt.param_groups[0]), False)
    round_counter_(w, new_w, seed, step, 0, 0, 0, paired=True)  # an SGD's: two to a word
    rounder = StochasticRounder(seed)
    rounder.step = step
    state_8bit.pack([(st, p)], {}, opt, rounder, {p: 0})
    assert torch.equal(bits(w), bits(p.detach())) and st.keys() == opt.state[p].keys()
    assert all(torch.equal(bits(st[k]), bits(opt.state[p][k])) for k in st)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")  # a zero-size layer, on purpose
@pytest.mark.parametrize("kind", list(SGDS))
def test_sgd_with_the_kernel_equals_the_eager_reference_through_a_skip_and_a_resume(lib, monkeypatch, tmp_path, kind):
    """As the AdamW test above, with SGD's 8-bit momentum buffer: four steps with a skipped one,
    saved (the buffer widened to float32, torch's format), two more and after a load into a fresh
    run: kernel and eager reference bit for bit, the resumed run the uninterrupted one."""
    data = batches(6)
    runs = {}
    for path in ("kernel", "eager"):
        monkeypatch.setattr(native, "_state", {} if path == "kernel" else {"lib": None})
        model, opt = o8_sgd(kind)
        calls = calls_of_own_step(opt)
        train(model, opt, data[:4], poison=(1,))
        assert not calls and current_run("t").scalers[0].skipped_steps == 1 and current_run("t").rounder.step == 3
        assert opt.state_dict()["state"][1]["momentum_buffer"].dtype == torch.float32  # saved widened: torch's format
        runs[path] = saved_trained_and_resumed(model, opt, data[4:], tmp_path / f"{path}.pt", lambda: o8_sgd(kind))
        assert same(runs[path][1], runs[path][2])
    assert all(same(a, b) for a, b in zip(runs["kernel"], runs["eager"]))
    assert not same(runs["kernel"][0], runs["kernel"][1])


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")  # a zero-size layer, on purpose
def test_sgd_a_chunk_with_a_non_finite_weight_writes_nothing(lib):
    """A NaN buffer code makes a new weight NaN: the step is skipped, weights and buffers keep their bits."""
    model, opt = o8_sgd("momentum")
    data = batches(3)
    train(model, opt, data[:2])
    opt.state[model.a.weight]["momentum_buffer.codes"][0, 0] = -128
    before = snapshot(model, opt)
    train(model, opt, data[2:])
    assert ampkit.step_was_skipped(opt) and same(before, snapshot(model, opt))
