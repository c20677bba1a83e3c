"""torch's step hooks around ampkit's step: once per step, post-hooks see the new model weights."""
import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import ampkit
from ampkit._update import chunks


def build(level, opt_cls=torch.optim.AdamW, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = opt_cls(model.parameters(), lr=1e-2)
    return ampkit.initialize(model, opt, opt_level=level, verbosity=0, **kw)


def train_step(model, opt, x=None):
    x = torch.randn(8, 16) if x is None else x
    opt.zero_grad()
    with ampkit.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    return opt.step()


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3", "O5", "O7"])
def test_post_hook_sees_the_new_weights_and_pre_hook_the_old(level):
    model, opt = build(level, opt_cls=torch.optim.SGD if level == "O3" else torch.optim.AdamW)  # O3: eps underflows
    seen = {"pre": [], "post": []}
    weight = model[0].weight
    opt.register_step_pre_hook(lambda o, a, k: seen["pre"].append(weight.detach().clone()))
    opt.register_step_post_hook(lambda o, a, k: seen["post"].append(weight.detach().clone()))
    for _ in range(3):
        before = weight.detach().clone()
        train_step(model, opt)
        assert torch.equal(seen["pre"][-1], before)
        assert torch.equal(seen["post"][-1], weight.detach()) and not torch.equal(before, weight.detach())
    assert len(seen["pre"]) == len(seen["post"]) == 3


@pytest.mark.parametrize("level", ["O2", "O5", "O7"])
def test_an_ema_kept_in_a_post_hook_does_not_lag(level):
    model, opt = build(level)
    ema = [p.detach().float().clone() for p in model.parameters()]

    def update(o, args, kwargs):
        for e, p in zip(ema, model.parameters()):
            e.copy_(p.detach().float())  # decay 0: the EMA is the current weights

    opt.register_step_post_hook(update)
    train_step(model, opt)
    assert all(torch.equal(e, p.detach().float()) for e, p in zip(ema, model.parameters()))


def test_a_skipped_step_runs_no_hook():
    model, opt = build("O2", opt_cls=torch.optim.SGD)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    train_step(model, opt, x=torch.full((8, 16), float("inf")))
    assert ampkit.step_was_skipped(opt) and calls == []
    train_step(model, opt)
    assert calls == ["pre", "post"]


def test_global_post_hooks_run_once_per_step():
    model, opt = build("O5")
    calls = []
    handle = register_optimizer_step_post_hook(lambda o, a, k: calls.append(o) if o is opt else None)
    try:
        train_step(model, opt)
        train_step(model, opt)
    finally:
        handle.remove()
    assert calls == [opt, opt]


class CountingSGD(torch.optim.SGD):
    """A custom optimizer that counts its steps in its param groups (warm-up schedules do)."""

    def step(self, closure=None):
        for g in self.param_groups:
            g["count"] = g.get("count", 0) + 1
            g["lr"] = 1e-2 * min(1.0, g["count"] / 4)
        return super().step(closure)


def test_o7_chunked_step_is_one_step_for_hooks_and_group_counters(monkeypatch):
    monkeypatch.setattr(chunks, "CHUNK_ELEMENTS", 64)  # several chunks for this small model
    model, opt = build("O7", opt_cls=CountingSGD)
    assert len(chunks.chunks([(None, 0, p) for p in model.parameters()], 64)) > 2
    pre, post = [], []
    opt.register_step_pre_hook(lambda *a: pre.append(1))
    opt.register_step_post_hook(lambda *a: post.append(1))
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(1, 4):
        train_step(model, opt)
        assert [g["count"] for g in opt.param_groups] == [step] and opt.param_groups[0]["lr"] == 1e-2 * step / 4
    assert len(pre) == len(post) == 3
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
