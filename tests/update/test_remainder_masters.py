"""master_weights="remainder": O5's fp32 masters held as the bf16 weight plus a 16-bit remainder
(and a side table for the few values 16 bits cannot hold).

Training is bit-identical to O5 (model weights and losses at every step, masters at the end) with
AdamW (fused, and with ``AMPKIT_FUSED=0``), SGD with momentum and Adagrad, across a skipped step and a resume: on a small model on data
that meets rounding ties, and on a model of a million parameters, where the side tables are in use
at every step.
"""
import pytest
import torch
from torch import nn

import ampkit
from ampkit._kernels import remainder as remainder_module
from ampkit._kernels.remainder import master, side_table

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=2**-10),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=2**-6, momentum=0.5),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=2**-6),
}


def build(master_weights, opt_name, seed=0, **kw):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    with torch.no_grad():  # weights on the bf16 grid and power-of-two data: masters meet rounding ties
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    opt = OPTIMIZERS[opt_name](model.parameters())
    return ampkit.initialize(model, opt, opt_level="O5", master_weights=master_weights, verbosity=0, **kw)


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield torch.randint(-4, 5, (8, 16), generator=g).float() / 4, torch.randint(-2, 3, (8, 4), generator=g).float() / 2


def train(model, opt, data, poison_at=()):
    losses, weights = [], []
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        if i in poison_at:
            loss = loss * float("inf")
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
        weights.append(torch.cat([p.detach().view(torch.int16).flatten() for p in model.parameters()]))
    return losses, weights


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.float32 and torch.equal(a.view(torch.int32), b.view(torch.int32))


def masters_of(model, opt):
    if model._ampkit.remainders:
        return [master(p.detach(), model._ampkit.remainders[p]) for p in model.parameters()]
    return [m.detach().clone() for m in ampkit.master_params(opt)]


@pytest.mark.parametrize("opt_name,fused", [(name, "1") for name in OPTIMIZERS] + [("adamw", "0")])
def test_bit_identical_to_o5_for_200_steps_with_a_skipped_step(opt_name, fused, monkeypatch):
    """With AdamW both step in the fused update (``fused_update.py``), or with ``AMPKIT_FUSED=0``
    both in torch's."""
    monkeypatch.setenv("AMPKIT_FUSED", fused)
    ref, rem = build(True, opt_name), build("remainder", opt_name)
    a = train(*ref, batches(200), poison_at={57})
    b = train(*rem, batches(200), poison_at={57})
    assert ampkit.step_was_skipped(rem[1]) is False and ampkit.loss_scalers(rem[1])[0].skipped_steps == 1
    assert a[0][:57] == b[0][:57] and a[0][58:] == b[0][58:]
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    assert all(same_bits(x, y) for x, y in zip(masters_of(*ref), masters_of(*rem)))


@pytest.mark.parametrize("opt_name", ["adamw", "sgd_momentum"])
def test_resume_is_bit_identical_to_o5_and_to_an_uninterrupted_run(opt_name):
    ref = build(True, opt_name)
    a = train(*ref, batches(120))
    first = build("remainder", opt_name)
    data = list(batches(120))
    train(*first, data[:60])
    ckpt = {"model": first[0].state_dict(), "optimizer": first[1].state_dict(), "amp": ampkit.state_dict(optimizer=first[1])}
    assert all(v.dtype == torch.float32 for v in ckpt["model"].values())  # fp32 masters, as at O5
    resumed = build("remainder", opt_name, seed=5)
    resumed[0].load_state_dict(ckpt["model"])
    resumed[1].load_state_dict(ckpt["optimizer"])
    ampkit.load_state_dict(ckpt["amp"], optimizer=resumed[1])
    b = train(*resumed, data[60:])
    assert a[0][60:] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1][60:], b[1]))


def test_state_dict_gives_o5_masters_and_twelve_bytes_per_parameter_with_adamw():
    ref, rem = build(True, "adamw"), build("remainder", "adamw")
    train(*ref, batches(30)), train(*rem, batches(30))
    for (k, v), w in zip(ref[0].state_dict().items(), rem[0].state_dict().values()):
        assert same_bits(v, w), k
    ref[1].zero_grad(), rem[1].zero_grad()
    assert ampkit.footprint.bytes_per_param([ref[0]], [ref[1]]) == pytest.approx(14, abs=0.05)
    assert ampkit.footprint.bytes_per_param([rem[0]], [rem[1]]) == pytest.approx(12, abs=0.05)
    state = build("remainder", "adamw", optimizer_state_dtype=torch.bfloat16)
    train(*state, batches(2))
    state[1].zero_grad()
    assert ampkit.footprint.bytes_per_param([state[0]], [state[1]]) == pytest.approx(8, abs=0.05)


def plus_ones(state_dict, where):
    """``state_dict`` with the values at flat indices ``where[key]`` moved to 32767 float32 ULPs
    above an even bf16 value (low 17 bits 0x07FFF): what 16 bits alone cannot hold."""
    out = {k: v.clone() for k, v in state_dict.items()}
    for key, at in where.items():
        bits = out[key].view(-1).view(torch.int32)
        bits[at] = bits[at].bitwise_and(~0x1FFFF).bitwise_or(0x7FFF)
    return out


# -- a million parameters: side tables in use at every step ----------------------------------

LARGE_OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
}


def build_large(master_weights, opt_name, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 2048), nn.Tanh(), nn.Linear(2048, 256), nn.Tanh(), nn.Linear(256, 16))
    opt = LARGE_OPTIMIZERS[opt_name](model.parameters())
    return ampkit.initialize(model, opt, opt_level="O5", master_weights=master_weights, verbosity=0)


def large_step(model, opt, x, y, poison=False):
    opt.zero_grad()
    loss = (model(x).float() - y).pow(2).mean()
    with ampkit.scale_loss(loss * float("inf") if poison else loss, opt) as scaled:
        scaled.backward()
    opt.step()
    return loss.detach().view(torch.int32).item()


def checkpoint(model, opt):
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": ampkit.state_dict(optimizer=opt)}


def resume(ckpt, opt_name):
    model, opt = build_large("remainder", opt_name, seed=5)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    ampkit.load_state_dict(ckpt["amp"], optimizer=opt)
    return model, opt


@pytest.mark.slow
@pytest.mark.parametrize("opt_name,fused", [(name, "1") for name in LARGE_OPTIMIZERS] + [("adamw", "0")])
def test_a_million_parameters_bit_identical_to_o5_for_200_steps_with_a_skipped_step_and_a_resume(opt_name, fused,
                                                                                                 monkeypatch):
    """About 8 masters of a million sit where 16 bits cannot hold them at any step (with the 16
    bits alone, before side tables, the weights left O5's within these 200 steps with each of
    the three optimizers): here the bf16 weights and losses equal
    O5's at each of 200 steps, across a skipped step (57) and a resume from a checkpoint (120)
    into a fresh run, and the masters equal O5's bit for bit at the resume and at the end. (AdamW:
    both in the fused update, and both in torch's step with ``AMPKIT_FUSED=0``.)"""
    monkeypatch.setenv("AMPKIT_FUSED", fused)
    ref, rem = build_large(True, opt_name), build_large("remainder", opt_name)
    assert sum(p.numel() for p in rem[0].parameters()) > 10**6
    g = torch.Generator().manual_seed(1)
    listed = []
    for step in range(200):
        x, y = torch.randn(8, 256, generator=g), torch.randn(8, 16, generator=g)
        if step == 120:
            ckpt = checkpoint(*rem)
            assert all(same_bits(v, w) for v, w in zip(masters_of(*ref), ckpt["model"].values()))
            rem = resume(ckpt, opt_name)
        losses = [large_step(*run, x, y, poison=step == 57) for run in (ref, rem)]
        assert losses[0] == losses[1], step
        assert ampkit.step_was_skipped(ref[1]) is ampkit.step_was_skipped(rem[1]) is (step == 57), step
        for p, q in zip(ref[0].parameters(), rem[0].parameters()):
            assert torch.equal(p.detach().view(torch.int16), q.detach().view(torch.int16)), step
        listed.append(sum(side_table(r).numel() for r in rem[0]._ampkit.remainders.values()))
    assert max(listed) > 0  # the tables were in use
    assert all(same_bits(v, w) for v, w in zip(masters_of(*ref), masters_of(*rem)))


@pytest.mark.parametrize("opt_name,fused", [("adamw", "1"), ("adamw", "0"), ("sgd_momentum", "1")])
def test_each_side_table_owns_its_entries_twelve_bytes_a_parameter_and_eight_an_entry(opt_name, fused, monkeypatch):
    """After steps of AdamW (the fused kernel, or torch's step and ``split_``) or SGD with momentum
    (fused) on a million parameters, each remainder's side table is a tensor of exactly its entries
    in its own storage (an empty one is no table at all), and the footprint is 12 bytes a parameter
    with AdamW (bf16 weight, int16 remainder, fp32 ``exp_avg`` and ``exp_avg_sq``), 8 with SGD (its
    fp32 ``momentum_buffer``), plus 8 an entry, step counters apart."""
    monkeypatch.setenv("AMPKIT_FUSED", fused)
    model, opt = build_large("remainder", opt_name)
    state_bytes = 8 if opt_name == "adamw" else 4
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        large_step(model, opt, torch.randn(8, 256, generator=g), torch.randn(8, 16, generator=g))
    opt.zero_grad()
    entries = 0
    for r in model._ampkit.remainders.values():
        table = vars(r).get(remainder_module._TABLE)
        if table is not None:
            assert table.dtype == torch.int64 and table.numel() > 0 and table._base is None
            assert table.untyped_storage().nbytes() == 8 * table.numel()
            entries += table.numel()
    assert entries > 0  # the tables are in use
    fp = ampkit.footprint.persistent_bytes([model], [opt])
    params = sum(p.numel() for p in model.parameters())
    assert fp["total"] - fp["buffers"] - fp["optimizer_scalars"] == (4 + state_bytes) * params + 8 * entries
    assert fp["masters"] == 2 * params + 8 * entries
    assert fp["optimizer_state"] - fp["optimizer_scalars"] == state_bytes * params


SGD_GROUPS = {
    "momentum": dict(lr=2**-6, momentum=0.5),
    "nesterov_decay": dict(lr=2**-6, momentum=0.9, nesterov=True, weight_decay=0.01),
    "dampening_maximize": dict(lr=2**-6, momentum=0.9, dampening=0.1, maximize=True),
    "no_momentum": dict(lr=2**-6),
}


@pytest.mark.parametrize("kw", list(SGD_GROUPS.values()), ids=list(SGD_GROUPS))
def test_sgd_steps_fused_keeps_torchs_buffer_and_o5s_bits(kw, monkeypatch):
    """An exact ``torch.optim.SGD`` steps remainder masters in the fused pass, every step but the
    skipped one; its state is torch's (a float32 ``momentum_buffer`` keyed by the parameter, none
    at momentum 0); weights, masters and buffers equal O5's (its fused SGD masters) bit for bit."""
    from ampkit._update import fused_sgd_update
    calls, real = [], fused_sgd_update.step_remainders
    monkeypatch.setattr(fused_sgd_update, "step_remainders", lambda *a: (calls.append(1), real(*a))[1])
    runs = {}
    for mw in (True, "remainder"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        runs[mw] = ampkit.initialize(model, torch.optim.SGD(model.parameters(), **kw), opt_level="O5",
                                     master_weights=mw, verbosity=0)
    a, b = (train(*runs[mw], batches(30), poison_at={7}) for mw in (True, "remainder"))
    assert len(calls) == 29 and a[0][:7] == b[0][:7] and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    (ref_model, ref_opt), (model, opt) = runs[True], runs["remainder"]
    assert all(same_bits(x, y) for x, y in zip(masters_of(ref_model, ref_opt), masters_of(model, opt)))
    for m, p in zip(ampkit.master_params(ref_opt), model.parameters()):
        state = opt.state[p]
        if kw.get("momentum", 0) == 0:
            assert state == ref_opt.state[m] == {}
            continue
        assert list(state) == ["momentum_buffer"] and state["momentum_buffer"].dtype == torch.float32
        assert same_bits(state["momentum_buffer"], ref_opt.state[m]["momentum_buffer"])


def snapshot(model, opt):
    """Weights, remainders and side tables (as bits), and the optimizer's state (cloned)."""
    rs = model._ampkit.remainders
    return ([p.detach().view(torch.int16).clone() for p in model.parameters()],
            [rs[p].clone() for p in model.parameters()], [side_table(rs[p]).clone() for p in model.parameters()],
            [{k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()} for p in model.parameters()])


@pytest.mark.parametrize("opt_name", ["adamw", "sgd_momentum"])
def test_a_skipped_step_leaves_weights_remainders_tables_and_state_untouched(opt_name):
    """An overflowing step on a million parameters, with side tables in use, changes nothing:
    weights, remainders, tables and optimizer state stay bit for bit; the next step moves them."""
    model, opt = build_large("remainder", opt_name)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 256, generator=g), torch.randn(8, 16, generator=g)) for _ in range(4)]
    for x, y in data[:3]:
        large_step(model, opt, x, y)
    before = snapshot(model, opt)
    assert sum(t.numel() for t in before[2]) > 0
    large_step(model, opt, *data[3], poison=True)
    assert ampkit.loss_scalers(opt)[0].skipped_steps == 1
    after = snapshot(model, opt)
    for got, want in zip(after[:3], before[:3]):
        assert all(torch.equal(x, y) for x, y in zip(got, want))
    for got, want in zip(after[3], before[3]):
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    large_step(model, opt, *data[3])
    assert not all(torch.equal(x, y) for x, y in zip(snapshot(model, opt)[0], before[0]))


def test_loaded_masters_16_bits_cannot_hold_are_kept_counted_and_saved_exactly(tmp_path):
    """A checkpoint's fp32 masters load exactly, those 16 bits cannot hold into the side tables:
    ``state_dict`` (and ``ampkit.checkpoint`` into a fresh run) gives them back bit for bit, the
    weights are O5's rounding of them, and the footprint counts the tables (8 bytes an entry) on
    top of 12 bytes per parameter."""
    first, opt = build("remainder", "adamw")
    train(first, opt, batches(3))
    where = {"0.weight": [0, 7, 511], "0.bias": [31], "2.weight": [100]}
    saved = plus_ones(first.state_dict(), where)
    first.load_state_dict(saved)
    ampkit.checkpoint.save(tmp_path / "run.pt", first, opt)
    model, opt = build("remainder", "adamw", seed=3)
    ampkit.checkpoint.load(tmp_path / "run.pt", model, opt)
    tables = {k: side_table(model._ampkit.remainders[p]).tolist() for k, p in model.named_parameters()}
    assert tables == {k: where.get(k, []) for k in tables}
    for (k, v), p in zip(model.state_dict().items(), model.parameters()):
        assert same_bits(v, saved[k]), k
        assert torch.equal(p.detach().view(torch.int16), saved[k].bfloat16().view(torch.int16)), k
    import copy

    assert all(torch.equal(v, saved[k]) for k, v in copy.deepcopy(model).state_dict().items())  # an EMA copy's too
    opt.zero_grad()
    fp = ampkit.footprint.persistent_bytes([model], [opt])
    params = sum(p.numel() for p in model.parameters())
    assert fp["masters"] == 2 * params + 8 * 5 and fp["weights"] == 2 * params
    assert fp["total"] == 12 * params + 8 * 5 + fp["optimizer_scalars"]


def test_an_ema_copy_starts_from_the_exact_masters():
    import copy

    model, opt = build("remainder", "adamw")
    train(model, opt, batches(20))
    ema = copy.deepcopy(model)
    expected = masters_of(model, opt)
    assert all(torch.equal(v, m) for v, m in zip(ema.state_dict().values(), expected))


@pytest.mark.parametrize("level, kw, match", [
    ("O2", {}, r"master_weights='remainder'\): the bf16 weight plus a 16-bit remainder holds an fp32 master only for a bfloat16 model"),
    ("O5", {"half_dtype": torch.float16}, "only for a bfloat16 model"),
])
def test_refused_for_float16_models(level, kw, match):
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=match):
        ampkit.initialize(model, opt, opt_level=level, master_weights="remainder", **kw)
    assert model.weight.dtype == torch.float32 and not hasattr(opt, "_ampkit")


def test_a_bad_value_names_the_accepted_ones():
    model = nn.Linear(4, 4)
    with pytest.raises(TypeError, match=r"master_weights='rem'\): expected True, False or 'remainder'"):
        ampkit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O5", master_weights="rem")
