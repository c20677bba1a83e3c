"""O8 with ``torch.optim.SGD`` momentum (its 8-bit buffer stepped by the fused kernel, the fp32
BatchNorm in the fused masters' op) under DDP on 2 gloo ranks against one process over the same
batches: the ranks hold bit-identical weights and buffers, equal to the one process's up to the
gradients' summation order; through a skipped step and a resume, the resumed run is the
uninterrupted one bit for bit (its counter bits, two elements to a word, are a function of the
step and the global index)."""
import io

import pytest
import torch
from torch import nn

import ampkit
from ampkit.parallel import DistributedDataParallel

from ._launch import run
from ._models import micro_batches, train_steps

STEPS, PER_RANK = 4, 4
OPTIONS = {"momentum": dict(momentum=0.9, weight_decay=5e-4), "nesterov": dict(momentum=0.8, nesterov=True)}
HALF_CLOSE = dict(rtol=2e-2, atol=2e-2)  # bf16 weights: a rounding apart where a gradient's last bit differs


def _build(kind):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 300), nn.BatchNorm1d(300), nn.Tanh(), nn.Linear(300, 3))  # 1200 weights:
    net.eval()[1].running_mean.uniform_(-0.5, 0.5)  # several blocks of 256; running stats, the same everywhere
    opt = torch.optim.SGD(net.parameters(), lr=0.05, **OPTIONS[kind])
    return ampkit.initialize(net, opt, opt_level="O8", verbosity=0, max_loss_scale=2.0**10)


def _train(model, opt, data, ddp=None):
    train_steps(ddp or model, opt, data)
    return ([p.detach().clone() for p in model.parameters()],
            [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()])


def _worker(rank, world_size):
    from ampkit._update import fused_sgd_update_8bit

    calls, inner = [], fused_sgd_update_8bit.step
    fused_sgd_update_8bit.step = lambda *a: calls.append(1) or inner(*a)
    out = {}
    for kind in OPTIONS:
        model, opt = _build(kind)
        out[kind] = _train(model, opt, micro_batches(STEPS, 1, PER_RANK, rank), DistributedDataParallel(model))
    out["fused calls"] = len(calls)
    return out


POISONED, SAVE_AT = 1, 3  # the step with an inf target (skipped everywhere), the step after which the run is saved


def _poisoned_batches(rank=None):
    """`micro_batches` of STEPS + 2 steps, step POISONED's first target inf on every rank."""
    data = micro_batches(STEPS + 2, 1, PER_RANK, rank)
    data[POISONED][0][1][0, 0] = float("inf")
    return data


def _resumed(kind, data, wrap):
    """Weights and states of the run through ``data`` uninterrupted and of a fresh run loaded from
    its save after SAVE_AT steps, and its skipped steps."""
    model, opt = _build(kind)
    _train(model, opt, data[:SAVE_AT], wrap(model))
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": ampkit.state_dict(optimizer=opt)}, saved)
    whole = _train(model, opt, data[SAVE_AT:], wrap(model))
    fresh, fresh_opt = _build(kind)
    saved.seek(0)
    ckpt = torch.load(saved)
    fresh.load_state_dict(ckpt["model"])
    fresh_opt.load_state_dict(ckpt["optimizer"])
    ampkit.load_state_dict(ckpt["amp"], optimizer=fresh_opt)
    return {"whole": whole, "resumed": _train(fresh, fresh_opt, data[SAVE_AT:], wrap(fresh)),
            "skipped": opt._ampkit.run.scalers[0].skipped_steps}


def _resume_worker(rank, world_size):
    return _resumed("momentum", _poisoned_batches(rank), DistributedDataParallel)


@pytest.fixture(scope="module")
def ranks():
    return run(_worker, 2)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(OPTIONS))
def test_two_ranks_agree_bit_for_bit_and_match_one_process(ranks, kind):
    model, opt = _build(kind)
    weights, states = _train(model, opt, micro_batches(STEPS, 1, PER_RANK))
    (wa, sa), (wb, sb) = ranks[0][kind], ranks[1][kind]
    assert ranks[0]["fused calls"] == ranks[1]["fused calls"] == STEPS * len(OPTIONS)  # O8's SGD kernel stepped
    assert all(torch.equal(x, y) for x, y in zip(wa, wb))
    assert all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(sa, sb))
    for got, want, state in zip(wa, weights, sa):
        if got.dtype == torch.float32:  # the BatchNorm: torch's float32 buffer
            assert set(state) == {"momentum_buffer"} and state["momentum_buffer"].dtype == torch.float32
        else:
            assert got.dtype == torch.bfloat16 and set(state) == {"momentum_buffer.codes", "momentum_buffer.scales"}
            assert state["momentum_buffer.codes"].dtype == torch.int8
        torch.testing.assert_close(got.float(), want.float(), **HALF_CLOSE)
    assert [w.dtype for w in wa] == [torch.bfloat16] * 2 + [torch.float32] * 2 + [torch.bfloat16] * 2
    assert any(not torch.equal(a, b) for a, b in zip(wa, _build(kind)[0].parameters()))  # it trained


def _same(a, b) -> bool:
    (wa, sa), (wb, sb) = a, b
    return (all(torch.equal(x, y) for x, y in zip(wa, wb))
            and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(sa, sb)))


@pytest.mark.slow
def test_a_skipped_step_and_a_resume_on_two_ranks_match_one_process():
    ranks = run(_resume_worker, 2)
    single = _resumed("momentum", _poisoned_batches(), lambda model: None)
    for out in ranks + [single]:
        assert out["skipped"] == 1 and _same(out["whole"], out["resumed"])  # the resume is bit-exact
    assert _same(ranks[0]["whole"], ranks[1]["whole"])
    for got, want in zip(ranks[0]["whole"][0], single["whole"][0]):
        torch.testing.assert_close(got.float(), want.float(), **HALF_CLOSE)
