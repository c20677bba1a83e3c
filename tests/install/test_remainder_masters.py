"""master_weights="remainder": O5's fp32 masters held as the bf16 weight plus a 16-bit remainder.

Training is bit-identical to O5 (model weights and losses at every step) on a small model, on data
that meets rounding ties, with AdamW, SGD with momentum and Adagrad, across a skipped step and a resume.
"""
import pytest
import torch
from torch import nn

import ampkit
from ampkit.core.remainder import master

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


def masters_of(model, opt):
    if model._ampkit.remainders:
        return [master(p.detach(), model._ampkit.remainders[p]) for p in model.parameters()]
    return [m.detach().clone() for m in ampkit.master_params(opt)]


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_bit_identical_to_o5_for_200_steps_with_a_skipped_step(opt_name):
    ref, rem = build(True, opt_name), build("remainder", opt_name)
    a = train(*ref, batches(200), poison_at={57})
    b = train(*rem, batches(200), poison_at={57})
    assert ampkit.step_was_skipped(rem[1]) is False and ampkit.loss_scalers(rem[1])[0].skipped_steps == 1
    assert a[0][:57] == b[0][:57] and a[0][58:] == b[0][58:]
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    # The one value per even weight that 16 bits cannot hold was met: it is kept one float32 ulp
    # lower, and that difference is carried (float32 rounding moves it by an ulp or two) while the
    # bf16 weights agree.
    diff = [(x.view(torch.int32) - y.view(torch.int32)).abs() for x, y in zip(masters_of(*ref), masters_of(*rem))]
    differing = sum(int((d != 0).sum()) for d in diff)
    assert differing <= 0.1 * sum(d.numel() for d in diff) and max(int(d.max()) for d in diff) <= 16
    assert differing >= 1


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
        assert v.dtype == w.dtype == torch.float32 and (v.view(torch.int32) - w.view(torch.int32)).abs().max() <= 1, k
    ref[1].zero_grad(), rem[1].zero_grad()
    assert ampkit.footprint.bytes_per_param([ref[0]], [ref[1]]) == pytest.approx(14, abs=0.05)
    assert ampkit.footprint.bytes_per_param([rem[0]], [rem[1]]) == pytest.approx(12, abs=0.05)
    state = build("remainder", "adamw", optimizer_state_dtype=torch.bfloat16)
    train(*state, batches(2))
    state[1].zero_grad()
    assert ampkit.footprint.bytes_per_param([state[0]], [state[1]]) == pytest.approx(8, abs=0.05)


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
