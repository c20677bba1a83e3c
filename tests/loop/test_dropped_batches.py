"""A batch dropped halfway (an exception inside or after ``scale_loss``, then ``zero_grad``)
leaves the run exactly where a run that never saw the batch would be; nested
``scale_loss`` on one optimizer is refused, an optimizer listed twice counts once."""
import pytest
import torch
from torch import nn

import ampkit
from ampkit._run.registry import current as current_run

LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
WHERE = ["before_backward", "after_backward", "after_block", "after_block_overflow", "after_backward_overflow"]


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def batches(n=5):
    g = torch.Generator().manual_seed(1)
    return [(0.5 * torch.randn(8, 4, generator=g), 0.5 * torch.randn(8, 3, generator=g)) for _ in range(n)]


class Dropped(Exception):
    pass


def _loss(model, x, y, overflow=False):
    out = model(x)
    loss = nn.functional.mse_loss(out, y)
    return loss * float("inf") if overflow else loss


def initialized(level, adam=True):
    """``Tiny`` (seed 0) and AdamW (or SGD), through ``initialize`` at ``level``."""
    torch.manual_seed(0)
    model = Tiny()
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3) if adam
           else torch.optim.SGD(model.parameters(), lr=0.1))
    return ampkit.initialize(model, opt, opt_level=level, verbosity=0)


def run(level, drop=None, where=None, exc=Dropped):
    """Train on ``batches()``; batch ``drop`` is dropped at ``where`` by raising ``exc``."""
    model, opt = initialized(level)
    for i, (x, y) in enumerate(batches()):
        opt.zero_grad()
        if i != drop:
            with ampkit.scale_loss(_loss(model, x, y), opt) as s:
                s.backward()
            opt.step()
            continue
        try:
            with ampkit.scale_loss(_loss(model, x, y, overflow=where.endswith("overflow")), opt) as s:
                if where == "before_backward":
                    raise exc("bad sample")
                s.backward()
                if where.startswith("after_backward"):
                    raise exc("bad sample")
            raise exc("out of memory, retry later")  # after the block, before step()
        except exc:
            pass
    return snapshot(model, opt)


def snapshot(model, opt):
    """Everything a dropped batch could have touched: weights, masters, optimizer and scaler state."""
    scaler = current_run("test").scalers[0]
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "params": [p.detach().clone() for p in model.parameters()],
        "masters": [p.detach().clone() for p in ampkit.master_params(opt)],
        "opt": repr(opt.state_dict()["state"]),
        "scaler": (scaler.loss_scale(), scaler.unskipped, scaler.skipped_steps),
    }


def assert_same_run(a, b):
    assert a["scaler"] == b["scaler"]
    assert a["opt"] == b["opt"]
    for key in ("params", "masters"):
        assert all(torch.equal(p, q) for p, q in zip(a[key], b[key])), key
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("level", LEVELS)
def test_dropped_batch_equals_a_run_that_never_saw_it(level, where):
    without = run(level, drop=None)
    ref = run_without(level, 2)  # the same loop over the same batches minus batch 2
    assert_same_run(run(level, drop=2, where=where), ref)
    assert_same_run(run(level, drop=2, where=where, exc=KeyboardInterrupt), ref)
    assert not all(torch.equal(p, q) for p, q in zip(without["params"], ref["params"]))  # the batch mattered


def run_without(level, skip):
    model, opt = initialized(level)
    for i, (x, y) in enumerate(batches()):
        if i == skip:
            model(x)  # the dropped batch's forward ran (no buffers here, so no effect)
            continue
        opt.zero_grad()
        with ampkit.scale_loss(_loss(model, x, y), opt) as s:
            s.backward()
        opt.step()
    return snapshot(model, opt)


def grad_scaler_run(drop, where):
    """The same loop with torch.autocast(float16) + torch.amp.GradScaler (what O1 does)."""
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for i, (x, y) in enumerate(batches()):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        if i == drop:
            try:
                if where.endswith("overflow"):
                    loss = loss * float("inf")
                if where != "before_backward":
                    scaler.scale(loss).backward()
                raise Dropped()
            except Dropped:
                continue
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return [p.detach().clone() for p in model.parameters()], scaler.get_scale()


@pytest.mark.parametrize("where", WHERE)
def test_dropped_batch_matches_torch_grad_scaler(where):
    params, scale = grad_scaler_run(2, where)
    ours = run("O1", drop=2, where=where)
    assert ours["scaler"][0] == scale
    for p, q in zip(ours["params"], params):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_dropped_batch_without_zero_grad_accumulates_like_grad_scaler():
    """No zero_grad after the drop: its (still scaled) gradients add to the next batch's,
    unscaled once, as GradScaler's do; never applied as if they were clean."""
    model, opt = initialized("O2", adam=False)
    ref = Tiny()
    ref.load_state_dict(model.state_dict())
    (x1, y1), (x2, y2) = batches(2)
    try:
        with ampkit.scale_loss(_loss(model, x1, y1), opt) as s:
            s.backward()
            raise Dropped()
    except Dropped:
        pass
    with ampkit.scale_loss(_loss(model, x2, y2), opt) as s:
        s.backward()
    opt.step()
    (_loss(ref, x1, y1) + _loss(ref, x2, y2)).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    for (k, v), r in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(v, r, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_nested_scale_loss_on_one_optimizer_is_refused(level):
    model, opt = initialized(level, adam=False)
    x, y = batches(1)[0]
    with pytest.raises(RuntimeError, match="already inside an enclosing `with ampkit.scale_loss"):
        with ampkit.scale_loss(_loss(model, x, y), opt) as outer:
            with ampkit.scale_loss(_loss(model, x, y), [opt]):
                pass
            outer.backward()
    opt.zero_grad()  # the dropped batch is discarded; training goes on normally
    before = [p.detach().clone() for p in ampkit.master_params(opt)]
    with ampkit.scale_loss(_loss(model, x, y), opt) as s:
        s.backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(before, ampkit.master_params(opt)))


@pytest.mark.parametrize("level", LEVELS)
def test_same_optimizer_twice_in_the_list_counts_once(level):
    results = []
    for twice in (False, True):
        model, opt = initialized(level, adam=False)
        x, y = batches(1)[0]
        with ampkit.scale_loss(_loss(model, x, y), [opt, opt] if twice else opt) as s:
            s.backward()
        results.append([p.grad.clone() for p in ampkit.master_params(opt)])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("flag", ["delay_overflow_check", "delay_unscale"])
@pytest.mark.parametrize("level", LEVELS)
def test_dropped_batch_with_delayed_check_or_unscale(level, flag):
    """An overflowing batch dropped after a scale_loss(..., delay_overflow_check/delay_unscale=True)
    block: its pending check or still-scaled gradients go with zero_grad()."""
    model, opt = initialized(level)
    for i, (x, y) in enumerate(batches()):
        opt.zero_grad()
        try:
            with ampkit.scale_loss(_loss(model, x, y, overflow=i == 2), opt, **{flag: True}) as s:
                s.backward()
            if i == 2:
                raise Dropped()
            opt.step()
        except Dropped:
            pass
    scaler = current_run("test").scalers[0]
    ours = {"params": [p.detach().clone() for p in model.parameters()],
            "masters": [p.detach().clone() for p in ampkit.master_params(opt)],
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "opt": repr(opt.state_dict()["state"]),
            "scaler": (scaler.loss_scale(), scaler.unskipped, scaler.skipped_steps)}
    assert_same_run(ours, run_without(level, 2))
