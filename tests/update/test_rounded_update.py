"""O7 / update_rounding: bf16 weights, the update computed in fp32 per step and rounded back.

Checked against a hand-written loop (fp32 copies of the bf16 weights stepped by the same
torch optimizer, rounded back with the same counter bits), plus skips, chunking and resume.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit._update import chunks
from ampkit._run.registry import current as current_run
from ampkit._kernels.rounding import StochasticRounder

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
}


def make_model(bn: bool = False):
    torch.manual_seed(0)
    layers = [nn.Linear(8, 32), nn.Tanh()] + ([nn.BatchNorm1d(32)] if bn else []) + [nn.Linear(32, 4)]
    return nn.Sequential(*layers)


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(n)]


def train(model, opt, data):
    """One step per ``(x, y)`` of ``data`` (MSE loss); the losses."""
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def o7(opt_name="adamw", bn=False, **kw):
    model = make_model(bn)
    opt = OPTIMIZERS[opt_name](model.parameters())
    return ampkit.initialize(model, opt, opt_level="O7", verbosity=0, **kw)


def reference(opt_name, data, rounding):
    """bf16 weights; each step: fp32 copies (kept only as the optimizer's state keys, refilled
    from the bf16 weights every step), the same torch optimizer, rounded back in one call."""
    model = make_model().to(torch.bfloat16)
    params = list(model.parameters())
    shadows = [p.detach().float() for p in params]
    opt = OPTIMIZERS[opt_name](shadows)
    rounder = StochasticRounder(0)
    for x, y in data:
        for p in params:
            p.grad = None
        F.mse_loss(model(x.to(torch.bfloat16)).float(), y).backward()
        with torch.no_grad():
            for p, s in zip(params, shadows):
                s.copy_(p.float())
                s.grad = p.grad.float()
            opt.step()
            if rounding == "stochastic":  # tensor i of the optimizer: the bits of (0, step, i, element, 0)
                rounder.round_(params, [s.clone() for s in shadows], list(range(len(params))), [0] * len(params))
                rounder.advance()
            else:
                torch._foreach_copy_(params, shadows)
    return model, opt, shadows


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_equals_the_hand_written_loop(opt_name, rounding, monkeypatch):
    """Through the optimizer's own step (the fused AdamW off: test_fused_update.py checks it)."""
    monkeypatch.setenv("AMPKIT_FUSED", "0")
    data = batches(4)
    model, opt = o7(opt_name, update_rounding=rounding)
    train(model, opt, data)
    ref_model, ref_opt, shadows = reference(opt_name, data, rounding)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q)
    for p, s in zip(model.parameters(), shadows):
        mine, theirs = opt.state[p], ref_opt.state[s]
        assert mine.keys() == theirs.keys()
        for k in mine:
            assert mine[k].dtype == theirs[k].dtype and torch.equal(mine[k], theirs[k]), k
    assert not opt._ampkit.masters and all(p in opt.state for p in model.parameters())


def test_stochastic_rounding_moves_weights_nearest_rounding_cannot():
    """Weights of 1.0 and every update below 2**-9, half the bf16 gap below 1.0: nearest
    rounding moves none of them; stochastic rounding moves some, on average by the update."""
    data = batches(1)
    for rounding, moved in (("nearest", False), ("stochastic", True)):
        model = make_model()
        nn.init.ones_(model[0].weight)
        opt = torch.optim.SGD(model[0].parameters(), lr=0.05)
        model, opt = ampkit.initialize(model, opt, opt_level="O7", update_rounding=rounding, verbosity=0)
        before = [p.detach().clone() for p in model.parameters()]
        train(model, opt, data)
        assert model[0].weight.grad.abs().max() * 0.05 < 2**-9
        assert (not torch.equal(before[0], model[0].weight)) is moved


def test_chunks_bound_the_transient_and_step_each_parameter_once():
    params = [torch.zeros(n, dtype=torch.bfloat16) for n in (3, 4, 10, 2, 2)] + [torch.zeros(5)]
    slots = [("g", i, p) for i, p in enumerate(params)]
    parts = chunks.chunks(slots, 6)
    assert [[s[1] for s in c] for c in parts] == [[0, 5], [1], [2], [3, 4]]  # fp32 joins the first; 10 > 6 alone


@pytest.mark.parametrize("rounding, state_dtype", [("nearest", None), ("stochastic", None), ("stochastic", torch.bfloat16)])
def test_chunked_step_equals_one_chunk(monkeypatch, rounding, state_dtype):
    """Each parameter is stepped once, in chunks, bit for bit as in one chunk: the stochastic
    rounding's bits depend on the element and the step, not on the chunks (the optimizer's
    own step: the fused AdamW has no chunks)."""
    monkeypatch.setenv("AMPKIT_FUSED", "0")
    data = batches(3)
    model, opt = o7(bn=True, update_rounding=rounding, optimizer_state_dtype=state_dtype)
    train(model, opt, data)
    calls = []
    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 40)
    small, small_opt = o7(bn=True, update_rounding=rounding, optimizer_state_dtype=state_dtype)
    own = {id(p) for p in small.parameters()}
    inner = small_opt._ampkit.update.own_step
    # Per optimizer call: the sizes of the transient fp32 copies it steps on.
    small_opt._ampkit.update.own_step = lambda: calls.append([p.numel() for g in small_opt.param_groups for p in g["params"]
                                                         if id(p) not in own]) or inner()
    train(small, small_opt, data)
    assert len(calls) == 3 * 4  # per step: [fc1.weight 256], [fc1.bias 32], [fc2.weight 128], [fc2.bias 4]
    assert all(sum(c) <= 40 or len(c) == 1 for c in calls)
    for p, q in zip(model.parameters(), small.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(model.parameters(), small.parameters()):
        for k in opt.state[p]:
            assert torch.equal(opt.state[p][k], small_opt.state[q][k])


def test_bf16_optimizer_state_and_fp32_batchnorm():
    model, opt = o7(bn=True, optimizer_state_dtype=torch.bfloat16)
    train(model, opt, batches(2))
    batchnorm = {id(model[2].weight), id(model[2].bias)}
    for p in model.parameters():
        expected = torch.float32 if id(p) in batchnorm else torch.bfloat16
        assert p.dtype == expected
        state = opt.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == expected and state["step"].dtype == torch.float32


def test_overflow_skip_leaves_weights_state_and_rounding_untouched():
    model, opt = o7(optimizer_state_dtype=torch.bfloat16)
    train(model, opt, batches(2))
    weights = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())
    rounding = current_run("test").rounder.state_dict()
    x, y = batches(1)[0]
    opt.zero_grad()
    loss = F.mse_loss(model(x), y) * float("inf")
    with ampkit.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert current_run("test").scalers[0].skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    after = opt.state_dict()
    assert all(torch.equal(state["state"][i][k], after["state"][i][k]) for i in state["state"] for k in state["state"][i])
    assert current_run("test").rounder.state_dict()["step"] == rounding["step"] == 2  # the skip drew nothing
    train(model, opt, batches(1))  # and the next clean step moves on
    assert any(not torch.equal(a, b) for a, b in zip(weights, model.parameters()))


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16])
def test_resume_is_bit_exact(tmp_path, state_dtype):
    data = batches(6)
    straight, straight_opt = o7(optimizer_state_dtype=state_dtype)
    train(straight, straight_opt, data)

    first, first_opt = o7(optimizer_state_dtype=state_dtype)
    train(first, first_opt, data[:3])
    path = tmp_path / "ckpt.pt"
    torch.save({"model": first.state_dict(), "optimizer": first_opt.state_dict(), "amp": ampkit.state_dict(optimizer=first_opt)}, path)
    assert all(v.dtype == torch.float32 for v in torch.load(path)["model"].values())

    second, second_opt = o7(optimizer_state_dtype=state_dtype)
    ckpt = torch.load(path)
    second.load_state_dict(ckpt["model"])
    second_opt.load_state_dict(ckpt["optimizer"])
    ampkit.load_state_dict(ckpt["amp"], optimizer=second_opt)
    for p in second.parameters():  # loading kept the state's precision (torch would cast it to bf16)
        assert second_opt.state[p]["exp_avg"].dtype == (state_dtype or torch.float32)
    train(second, second_opt, data[3:])
    for p, q in zip(straight.parameters(), second.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(straight.parameters(), second.parameters()):
        assert all(torch.equal(straight_opt.state[p][k], second_opt.state[q][k]) for k in straight_opt.state[p])


def test_failed_optimizer_load_leaves_the_optimizer_usable():
    model, opt = o7()
    train(model, opt, batches(1))
    params = [p for g in opt.param_groups for p in g["params"]]
    bad = opt.state_dict()
    bad["param_groups"] = bad["param_groups"] * 2
    with pytest.raises(ValueError):
        opt.load_state_dict(bad)
    assert [p for g in opt.param_groups for p in g["params"]] == params and all(p in opt.state for p in params)
    train(model, opt, batches(1))


def test_seed_changes_the_rounding_and_is_saved():
    data = batches(2)
    a, a_opt = o7()
    train(a, a_opt, data)
    b, b_opt = o7()
    ampkit.stochastic_rounding.manual_seed(1)
    assert ampkit.state_dict(optimizer=b_opt)["stochastic_rounding"]["seed"] == 1
    train(b, b_opt, data)
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_bad_rounding_state_is_refused_before_the_scalers_change():
    model, opt = o7()
    state = ampkit.state_dict(optimizer=opt)
    state["loss_scaler0"] = {"loss_scale": 8.0, "unskipped": 3}
    state["stochastic_rounding"] = {"seed": "x", "step": 0}
    with pytest.raises(ValueError, match=r"stochastic_rounding\['seed'\]='x'"):
        ampkit.load_state_dict(state, optimizer=opt)
    assert current_run("test").scalers[0].loss_scale() == 1.0


def test_rounding_state_without_stochastic_rounding_is_a_no_effect_warning():
    o7()
    state = ampkit.state_dict()
    model = make_model()
    ampkit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O5", verbosity=0)
    with pytest.warns(ampkit.NoEffectWarning, match="stochastic_rounding"):
        ampkit.load_state_dict(state)
    assert "stochastic_rounding" not in ampkit.state_dict()


def test_checkpoint_files_carry_the_rounding_state(tmp_path):
    data = batches(4)
    straight, straight_opt = o7()
    train(straight, straight_opt, data)
    first, first_opt = o7()
    train(first, first_opt, data[:2])
    ampkit.checkpoint.save(tmp_path / "run.ckpt", first, first_opt)
    train(first, first_opt, data[2:3])  # moves the step on: the load must bring them back
    ampkit.checkpoint.load(tmp_path / "run.ckpt", first, first_opt)
    train(first, first_opt, data[2:])
    assert all(torch.equal(p, q) for p, q in zip(straight.parameters(), first.parameters()))
