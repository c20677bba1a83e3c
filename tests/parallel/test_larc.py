"""ampkit.parallel.LARC, alone and through initialize/scale_loss (masters, skipped steps and
checkpoints through the wrapper), against a hand-written fp32-master loop; other
libraries' wrappers of the same shape are accepted too."""
import copy

import pytest
import torch
from torch import nn

import ampkit
from ampkit.fp16_utils import FP16_Optimizer
from ampkit._run.registry import current as current_run
from ampkit.parallel import LARC

HALF = {"O2": torch.float16, "O5": torch.bfloat16}
TC, LR, WD = 0.02, 0.5, 1e-2


def base_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def larc_by_hand(params, lr, wd, clip, eps=1e-8):
    """LARC's gradient adjustment, written out with Python floats."""
    for p in params:
        pn, gn = p.norm().item(), p.grad.norm().item()
        if pn != 0 and gn != 0:
            local = TC * pn / (gn + pn * wd + eps)
            if clip:
                local = min(local / lr, 1.0)
            p.grad = (p.grad + wd * p.detach()) * local


@pytest.mark.parametrize("clip", [True, False])
def test_larc_alone_matches_formula(clip):
    model = base_model()
    ref = copy.deepcopy(model)
    opt = LARC(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=WD), trust_coefficient=TC, clip=clip)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    with torch.no_grad():
        model[0].bias.zero_()  # a zero-norm parameter: left as it is
        ref[0].bias.zero_()
    for step in range(3):
        x, y = batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        larc_by_hand(list(ref.parameters()), LR, WD, clip)
        ref_opt.step()
    assert opt.param_groups[0]["weight_decay"] == WD  # restored after each step
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-7)


def test_larc_proxies_and_bad_input():
    model = base_model()
    inner = torch.optim.SGD(list(model.parameters())[:2], lr=LR)
    opt = LARC(inner)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    opt.add_param_group({"params": list(model.parameters())[2:]})
    assert len(inner.param_groups) == 2
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    assert opt.state_dict() == inner.state_dict() and "LARC(" in repr(opt)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    import pickle

    clone = pickle.loads(pickle.dumps(opt))
    assert clone.trust_coefficient == opt.trust_coefficient and len(clone.param_groups) == 2
    with pytest.raises(TypeError, match="LARC\\(optimizer"):
        LARC(model)
    with pytest.raises(ValueError, match="trust_coefficient"):
        LARC(inner, trust_coefficient=0)
    with pytest.raises(ValueError, match="eps"):
        LARC(inner, eps=-1.0)


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_larc_through_initialize_matches_hand_written_masters(level):
    """Masters in the wrapped optimizer's groups, LARC on the unscaled fp32 master grads,
    one overflowing step skipped (weights and momentum untouched), checkpoint and resume."""
    half, scale = HALF[level], 1024.0 if level == "O2" else 1.0
    base = base_model()
    masters = [p.detach().clone().requires_grad_() for p in base.parameters()]
    ref_model = copy.deepcopy(base).to(half)
    ref_opt = torch.optim.SGD(masters, lr=LR, momentum=0.9)

    model = copy.deepcopy(base)
    opt = LARC(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=WD), trust_coefficient=TC)
    model, opt2 = ampkit.initialize(model, opt, opt_level=level, verbosity=0)
    assert opt2 is opt
    if scale != 1.0:
        ampkit.load_state_dict({"loss_scaler0": {"loss_scale": scale, "unskipped": 0}})
    poison = [False]
    model[0].weight.register_hook(lambda g: g * float("inf") if poison[0] else g)
    assert all(p.dtype == torch.float32 for p in ampkit.master_params(opt))
    assert all(p.dtype == half for p in model.parameters())

    def amp_step(step):
        x, y = batch(step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()

    for step in range(4):
        poison[0] = step == 1
        before = [m.detach().clone() for m in ampkit.master_params(opt)]
        amp_step(step)
        if poison[0]:
            assert all(torch.equal(a, b) for a, b in zip(before, ampkit.master_params(opt)))
            if level == "O2":
                assert current_run("t").scalers[0].loss_scale() == scale / 2
                scale /= 2
            continue
        x, y = batch(step)
        for p in ref_model.parameters():
            p.grad = None
        loss = nn.functional.mse_loss(ref_model(x.to(half)).float(), y)
        (loss * scale).backward()
        for p, m in zip(ref_model.parameters(), masters):
            m.grad = p.grad.float() * (1.0 / scale)
        larc_by_hand(masters, LR, WD, True)
        ref_opt.step()
        with torch.no_grad():
            for p, m in zip(ref_model.parameters(), masters):
                p.copy_(m)
    for m, r in zip(ampkit.master_params(opt), masters):
        torch.testing.assert_close(m, r, rtol=1e-5, atol=1e-6)
    for p, r in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.float(), r.float(), rtol=0, atol=1e-2)

    # checkpoint through the wrapper, resume in a fresh model/LARC, continue both
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "amp": ampkit.state_dict()})
    assert all(v.dtype == torch.float32 for v in ckpt["model"].values())
    poison[0] = False
    amp_step(4)
    want = [m.detach().clone() for m in ampkit.master_params(opt)]
    model = copy.deepcopy(base)
    opt = LARC(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=WD), trust_coefficient=TC)
    model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    ampkit.load_state_dict(ckpt["amp"])
    amp_step(4)
    for m, w in zip(ampkit.master_params(opt), want):
        assert torch.equal(m, w)


class OtherWrapper:
    """A wrapper of the same shape from another library: instance attributes, own step."""

    def __init__(self, optimizer):
        self.inner = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self.steps = 0

    def step(self):
        self.steps += 1
        return self.inner.step()

    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, group):
        self.inner.add_param_group(group)


def test_other_wrapper_accepted_at_o2():
    model = base_model()
    ref = copy.deepcopy(model)
    opt = OtherWrapper(torch.optim.SGD(model.parameters(), lr=LR))
    model, opt = ampkit.initialize(model, opt, opt_level="O2", loss_scale=64.0, verbosity=0)
    assert all(p.dtype == torch.float32 for p in opt.inner.param_groups[0]["params"])
    x, y = batch(0)
    opt.zero_grad()
    with ampkit.scale_loss(nn.functional.mse_loss(model(x), y), [opt]) as scaled:
        scaled.backward()
    opt.step()
    assert opt.steps == 1
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    half_ref = copy.deepcopy(ref).half()
    (nn.functional.mse_loss(half_ref(x.half()).float(), y) * 64.0).backward()
    for r, h in zip(ref.parameters(), half_ref.parameters()):
        r.grad = h.grad.float() * (1 / 64.0)
    ref_opt.step()
    for m, r in zip(ampkit.master_params(opt), ref.parameters()):
        assert torch.equal(m, r)


def test_refused_optimizers():
    model = base_model().half()
    fp16_opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=LR), verbose=False)
    with pytest.raises(TypeError, match="FP16_Optimizer"):
        ampkit.initialize(base_model(), fp16_opt, opt_level="O1", verbosity=0)
    with pytest.raises(TypeError, match="got object"):
        ampkit.initialize(base_model(), object(), opt_level="O1", verbosity=0)


def test_module_surgery_through_larc():
    """replace_module_classes takes a LARC as its optimizers; training goes on through the same masters."""
    from ampkit.surgery import replace_module_classes

    class Scaled(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x) * 0.5

    model = base_model()
    opt = LARC(torch.optim.SGD(model.parameters(), lr=LR))
    model, opt = ampkit.initialize(model, opt, opt_level="O5", verbosity=0)
    masters = list(ampkit.master_params(opt))
    assert replace_module_classes(model, {nn.Linear: lambda m, n: Scaled(m)}, optimizers=opt) == {nn.Linear: 2}
    assert [id(m) for m in ampkit.master_params(opt)] == [id(m) for m in masters]
    x, y = batch(0)
    before = [m.detach().clone() for m in masters]
    with ampkit.scale_loss(nn.functional.mse_loss(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, ampkit.master_params(opt)))
    for p, m in zip(model.parameters(), ampkit.master_params(opt)):
        assert torch.equal(p, m.to(p.dtype))
