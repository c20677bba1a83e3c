"""fp32 master weights (O2/O5): per optimizer type against a hand-written reference loop,
clipping through ``master_params``, ``add_param_group``, ``step``/``zero_grad`` edge cases,
skipped steps and the one-device rule."""
import copy
import weakref

import pytest
import torch
from torch import nn

import ampkit
from ampkit._optim import optimizer_state
from ampkit._run.registry import current as current_run
from ampkit._optim.optimizer_state import check_devices

HALF = {"O2": torch.float16, "O5": torch.bfloat16}


SCALE = {"O2": 1024.0, "O3": 1.0, "O5": 1.0}  # O2's dynamic scale starts at 2**16; the tests set 1024


def init(model, opt, level, **kw):
    """``ampkit.initialize`` + (at O2) a dynamic scale of 1024, through the public
    ``load_state_dict``: 2**16 overflows float16 on these tiny models' first steps, and the
    reference loop is written for steps that are not skipped."""
    model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0, **kw)
    if current_run("init").scalers[0].dynamic:
        ampkit.load_state_dict({"loss_scaler0": {"loss_scale": SCALE[level], "unskipped": 0}}, optimizer=opt)
    return model, opt


class Net(nn.Module):
    """Half Linear layers around a BatchNorm that O2/O5 keep in float32 (stepped directly)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def loss_fn(out, y):
    return nn.functional.mse_loss(out, y)


class Reference:
    """fp32 master weights written out by hand: a half model (BatchNorm kept float32), fp32
    masters in the optimizer, grads unscaled into the masters, masters copied back."""

    def __init__(self, base, half, opt_cls, kw, scale):
        fp32 = [p.detach().clone() for p in base.parameters()]  # masters start from the fp32 values
        self.model = copy.deepcopy(base).to(half)
        self.model.bn.float()
        self.half, self.scale = half, scale
        self.pairs = [(p, f.requires_grad_()) if p.dtype == half else (p, p) for p, f in zip(self.model.parameters(), fp32)]
        self.opt = opt_cls([m for _, m in self.pairs], **kw)

    def step(self, x, y):
        for p, m in self.pairs:
            p.grad = m.grad = None
        loss = loss_fn(self.model(x.to(self.half)).float(), y)
        (loss.float() * self.scale).backward()
        assert all(torch.isfinite(p.grad).all() for p, _ in self.pairs), "the reference assumes no overflow"
        for p, m in self.pairs:
            m.grad = p.grad.float() * (1.0 / self.scale) if m is not p else p.grad * (1.0 / self.scale)
        self.opt.step()
        with torch.no_grad():
            for p, m in self.pairs:
                if m is not p:
                    p.copy_(m)
        return loss


def amp_step(model, opt, x, y, loss_id=0):
    opt.zero_grad()
    loss = loss_fn(model(x), y)
    with ampkit.scale_loss(loss, opt, loss_id=loss_id) as scaled:
        scaled.backward()
    opt.step()
    return loss


OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-3, "momentum": 0.5}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "nadam": (torch.optim.NAdam, {"lr": 1e-2}),
    "radam": (torch.optim.RAdam, {"lr": 1e-2}),
}
# fused=True on CPU in torch 2.13: SGD, Adam, AdamW, Adagrad (RMSprop has no fused variant).
FUSED_ON_CPU = {"sgd", "sgd_momentum", "adam", "adamw", "adagrad"}
CASES = [(name, variant) for name in OPTIMIZERS for variant in ("default", "foreach", "fused")
         if variant == "default" or (variant == "foreach" and name not in ("nadam", "radam")) or (variant == "fused" and name in FUSED_ON_CPU)]


def optimizer_kwargs(name, variant):
    cls, kw = OPTIMIZERS[name]
    kw = dict(kw)
    if variant != "default":
        kw[variant] = True
    return cls, kw


def test_fused_support_on_cpu_is_as_listed():
    """The parametrization's claim about fused=True on CPU, checked against this torch."""
    for name, (cls, kw) in OPTIMIZERS.items():
        p = nn.Parameter(torch.ones(2))
        p.grad = torch.ones(2)
        try:
            cls([p], **kw, fused=True).step()
            supported = True
        except (TypeError, RuntimeError):
            supported = False
        assert supported == (name in FUSED_ON_CPU), name


@pytest.mark.parametrize("grads", ["fresh", "reused"])
@pytest.mark.parametrize("name,variant", CASES)
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_matches_hand_written_master_weight_loop(level, name, variant, grads, monkeypatch):
    """Bit-identical either way the fp32 master gradients are held: fresh every step (small
    models) or one buffer per master reused across steps (large ones). O5's masters of a plain
    AdamW / Adam / SGD step in ampkit's fused update unless ``AMPKIT_FUSED=0``, which gives exactly
    this loop with torch's step (the fused ones are checked against this loop with their own
    arithmetic in test_fused_update.py, against torch's SGD in test_fused_sgd_update.py)."""
    monkeypatch.setattr(optimizer_state, "REUSED_GRADS_BYTES", 0 if grads == "reused" else 2**62)
    if level == "O5" and name in ("adam", "adamw", "sgd", "sgd_momentum") and variant != "fused":
        monkeypatch.setenv("AMPKIT_FUSED", "0")  # the rest never reach the fused update
    cls, kw = optimizer_kwargs(name, variant)
    base = Net()
    ref = Reference(base, HALF[level], cls, kw, SCALE[level])
    model = copy.deepcopy(base)
    model, opt = init(model, cls(model.parameters(), **kw), level)
    masters = list(ampkit.master_params(opt))
    assert [m.dtype for m in masters] == [torch.float32] * len(masters)
    assert [p.dtype for p in model.parameters()] == [HALF[level]] * 2 + [torch.float32] * 2 + [HALF[level]] * 2
    for step in range(4):
        x, y = batch(step)
        assert torch.equal(amp_step(model, opt, x, y), ref.step(x, y))
    # Bit-identical to the reference: model (half and fp32 BN), masters, optimizer state.
    for (n, p), (q, m), master in zip(model.named_parameters(), ref.pairs, masters):
        assert p.dtype == q.dtype and torch.equal(p, q), n
        assert torch.equal(master, m), n
        assert torch.equal(p, master.to(p.dtype)), n  # the model holds its masters, rounded
        mine, theirs = opt.state[master], ref.opt.state[m]
        assert mine.keys() == theirs.keys() and (mine or name == "sgd"), n
        for k in mine:
            assert torch.equal(torch.as_tensor(mine[k]), torch.as_tensor(theirs[k])), (n, k)
            if torch.is_tensor(mine[k]) and k != "step":
                assert mine[k].dtype == torch.float32, (n, k)
    assert torch.equal(model.bn.running_mean, ref.model.bn.running_mean)
    assert all(m.grad is None for m in masters[:2] + masters[4:])  # master grads released after step
    reused = [id(m) for m in opt._ampkit._grad_buffers]
    assert reused == ([id(m) for m in masters[:2] + masters[4:]] if grads == "reused" else [])


def test_masters_start_from_the_fp32_weights_and_take_over_existing_state():
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    amp_free_step = loss_fn(model(batch(0)[0]), batch(0)[1])
    amp_free_step.backward()
    opt.step()  # the optimizer has fp32 state before initialize
    exp_avg = opt.state[model.fc1.weight]["exp_avg"].clone()
    fc1 = model.fc1.weight
    fp32_value = fc1.detach().clone()
    model, opt = ampkit.initialize(model, opt, opt_level="O2", verbosity=0)
    master = opt.param_groups[0]["params"][0]
    assert master is not fc1 and master.dtype == torch.float32 and master.requires_grad
    assert torch.equal(master, fp32_value) and not torch.equal(master, fc1.float())  # not the rounded copy
    assert torch.equal(master.to(fc1.dtype), fc1)
    assert fc1 not in opt.state and torch.equal(opt.state[master]["exp_avg"], exp_avg)
    assert opt.state[master]["exp_avg"].dtype == torch.float32
    assert opt.param_groups[0]["params"][2] is model.bn.weight  # float32 params are stepped directly
    assert opt._ampkit.owner[master] is fc1 and opt._ampkit.masters[fc1] is master


def test_master_params_yields_what_the_optimizer_steps():
    model = Net()
    model, opt = ampkit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    listed = list(ampkit.master_params(opt))
    assert [id(t) for t in listed] == [id(t) for g in opt.param_groups for t in g["params"]]
    assert [t.dtype for t in listed] == [torch.float32] * 6
    assert not any(t is p for t in listed for p in (model.fc1.weight, model.fc2.weight))
    other = Net()
    other, opt1 = ampkit.initialize(other, torch.optim.SGD(other.parameters(), lr=0.1), opt_level="O1", verbosity=0)
    assert [id(t) for t in ampkit.master_params(opt1)] == [id(p) for p in other.parameters()]  # no masters at O1


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_clipping_through_master_params_clips_unscaled_gradients(level):
    base = Net()
    ref = Reference(base, HALF[level], torch.optim.SGD, {"lr": 0.5}, SCALE[level])
    model = copy.deepcopy(base)
    model, opt = init(model, torch.optim.SGD(model.parameters(), lr=0.5), level)
    x, y = batch(0)
    opt.zero_grad()
    with ampkit.scale_loss(loss_fn(model(x), y), opt) as scaled:
        scaled.backward()
    # The reference's unscaled gradients, clipped the same way.
    for p, m in ref.pairs:
        p.grad = None
    (loss_fn(ref.model(x.to(HALF[level])).float(), y) * ref.scale).backward()
    ref_grads = [p.grad.float() / ref.scale for p, _ in ref.pairs]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in ref_grads]))
    assert 1e-3 < expected.item() < 1e3  # an unscaled norm, nowhere near 2**16 times it
    assert all(p.grad is None for p in (model.fc1.weight, model.fc2.weight))  # half grads moved to the masters
    total = torch.nn.utils.clip_grad_norm_(ampkit.master_params(opt), max_norm=0.01)
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    clipped = [m.grad.clone() for m in ampkit.master_params(opt)]
    torch.testing.assert_close(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in clipped])),
                               torch.tensor(0.01), rtol=1e-5, atol=0)
    before = [m.detach().clone() for m in ampkit.master_params(opt)]
    opt.step()
    for m, b, g in zip(ampkit.master_params(opt), before, clipped):
        torch.testing.assert_close(m, b - 0.5 * g, rtol=0, atol=1e-7)


@pytest.mark.parametrize("level", ["O2", "O5"])
@pytest.mark.parametrize("named", [False, True])
def test_add_param_group_after_initialize_gets_masters(level, named):
    """fc1 at initialize, fc2 + bn added afterwards == both groups from the start."""
    base = Net()
    with torch.no_grad():  # masters made later start from the half weights: make fp32 == half here
        for p in base.parameters():
            p.copy_(p.to(HALF[level]))
    ref_model = copy.deepcopy(base)
    ref_groups = [{"params": list(ref_model.fc1.parameters())},
                  {"params": list(ref_model.fc2.parameters()) + list(ref_model.bn.parameters()), "lr": 3e-2}]
    ref_model, ref_opt = init(ref_model, torch.optim.Adam(ref_groups, lr=1e-2), level)
    model = copy.deepcopy(base)
    first = list(model.fc1.named_parameters()) if named else list(model.fc1.parameters())
    model, opt = init(model, torch.optim.Adam(first, lr=1e-2), level)
    assert model.fc2.weight.dtype == HALF[level] and model.fc2.weight not in opt._ampkit.masters

    tail = list(model.fc2.parameters()) + list(model.bn.parameters())
    names = ["fc2.weight", "fc2.bias", "bn.weight", "bn.bias"]
    opt.add_param_group({"params": list(zip(names, tail)) if named else tail, "lr": 3e-2})
    new = opt.param_groups[1]["params"]
    assert len(new) == 4 and new[0] is not model.fc2.weight and new[0].dtype == torch.float32
    assert torch.equal(new[0], model.fc2.weight.float()) and new[2] is model.bn.weight
    assert opt._ampkit.owner[new[0]] is model.fc2.weight and opt._ampkit.owner[new[1]] is model.fc2.bias
    assert opt.param_groups[1]["lr"] == 3e-2
    if named:
        assert opt.param_groups[1]["param_names"] == names
    # The model's checkpoint reports fc2 through its new master.
    assert model.state_dict()["fc2.weight"].data_ptr() == new[0].data_ptr()
    for step in range(3):
        amp_step(model, opt, *batch(step))
        amp_step(ref_model, ref_opt, *batch(step))
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), n
    for a, b in zip(ampkit.master_params(opt), ampkit.master_params(ref_opt)):
        assert torch.equal(a, b)
    assert torch.equal(model.fc2.weight, new[0].to(model.fc2.weight.dtype))
    assert opt.state[new[0]]["exp_avg"].dtype == torch.float32 and opt.state[new[0]]["step"].item() == 3


def test_add_param_group_with_a_parameter_already_held_changes_nothing():
    model = Net()
    model, opt = ampkit.initialize(model, torch.optim.SGD(model.fc1.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    groups = [list(g["params"]) for g in opt.param_groups]
    masters = dict(opt._ampkit.masters)
    for dup in ([model.fc1.weight], [opt.param_groups[0]["params"][1]], [model.fc2.weight, model.fc1.bias]):
        with pytest.raises(ValueError, match="more than one parameter group"):
            opt.add_param_group({"params": dup})
        assert [list(g["params"]) for g in opt.param_groups] == groups
        assert opt._ampkit.masters == masters and model.fc2.weight not in model._ampkit.masters
    with pytest.raises(TypeError, match="set"):
        opt.add_param_group({"params": {model.fc2.weight}})
    with pytest.raises(TypeError, match="only optimize Tensors"):
        opt.add_param_group({"params": [model.fc2.weight, "bias"]})
    assert len(opt.param_groups) == 1 and opt._ampkit.masters == masters and model._ampkit.masters == masters


def test_add_param_group_on_another_device_is_a_clear_error_and_changes_nothing():
    """master_weights=True needs one device per optimizer: a real meta-device parameter."""
    model = Net()
    model, opt = ampkit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    stranger = nn.Parameter(torch.zeros(3, dtype=torch.float16, device="meta"))
    groups = [list(g["params"]) for g in opt.param_groups]
    with pytest.raises(ValueError, match=r"one device.*'cpu', 'meta'"):
        opt.add_param_group({"params": [stranger]})
    assert [list(g["params"]) for g in opt.param_groups] == groups and stranger not in opt._ampkit.masters


class Elsewhere(torch.Tensor):
    """A storage-less tensor that reports another device (this machine has only a CPU);
    detaching works, any computation is refused."""

    @staticmethod
    def __new__(cls, shape, device):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32, device=device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return Elsewhere(args[0].shape, args[0].device)
        raise NotImplementedError(f"Elsewhere tensors do not compute ({func})")


@pytest.mark.parametrize("device", ["cuda:1", "xpu"])
def test_initialize_refuses_master_weights_over_two_devices_and_changes_nothing(device):
    model = Net()
    model.far = nn.Parameter(Elsewhere((3,), device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    groups = [list(g["params"]) for g in opt.param_groups]
    with pytest.raises(ValueError, match=rf"master_weights=True.*one device.*\['cpu', '{device}'\]"):
        ampkit.initialize(model, opt, opt_level="O2", verbosity=0)
    assert type(model) is Net and not hasattr(model, "_ampkit") and not hasattr(opt, "_ampkit")
    assert model.fc1.weight.dtype == torch.float32 and [list(g["params"]) for g in opt.param_groups] == groups
    assert "step" not in vars(opt)


def test_check_devices_refuses_two_devices_only_with_master_weights():
    cpu, meta = torch.zeros(2), torch.zeros(2, device="meta")
    with pytest.raises(ValueError, match=r"master_weights=True.*\['cpu', 'meta'\].*one optimizer per device"):
        check_devices([cpu, meta, cpu], use_masters=True)
    check_devices([cpu, meta], use_masters=False)
    check_devices([cpu, torch.ones(3)], use_masters=True)


@pytest.mark.parametrize("level", ["O2", "O5"])
@pytest.mark.parametrize("name", ["sgd_momentum", "adam"])
def test_step_before_any_backward(level, name):
    cls, kw = OPTIMIZERS[name]
    base = Net()
    ref = copy.deepcopy(base)
    ref, ref_opt = init(ref, cls(ref.parameters(), **kw), level)
    model = copy.deepcopy(base)
    model, opt = init(model, cls(model.parameters(), **kw), level)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # Apex failed here (masters were created lazily, in scale_loss)
    opt.zero_grad()
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert not opt.state and current_run("t").scalers[0].skipped_steps == 0
    for step in range(2):
        amp_step(model, opt, *batch(step))
        amp_step(ref, ref_opt, *batch(step))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_zero_grad_clears_model_and_master_grads(level, set_to_none):
    base = Net()
    ref = Reference(base, HALF[level], torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, SCALE[level])
    model = copy.deepcopy(base)
    model, opt = init(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), level)
    x, y = batch(7)
    # Leave every kind of gradient behind: clean master grads, fp32 BN grads, and the scaled half
    # grads of a delayed (delay_unscale=True) backward that is never finished (summed, still
    # scaled, into the master grads).
    with ampkit.scale_loss(loss_fn(model(x), y), opt) as scaled:
        scaled.backward()
    with ampkit.scale_loss(loss_fn(model(x), y), opt, delay_unscale=True) as scaled:
        scaled.backward()
    masters = list(ampkit.master_params(opt))
    assert masters[0].grad is not None and model.bn.weight.grad is not None and opt._ampkit.masters_scaled
    opt.zero_grad(set_to_none=set_to_none)
    for t in list(model.parameters()) + masters:
        if set_to_none:
            assert t.grad is None
        else:
            assert t.grad is None or (t.grad.abs().sum() == 0 and t.grad.dtype == t.dtype)
    if not set_to_none:
        assert masters[0].grad is not None  # zeroed in place, not dropped
    assert opt._ampkit.scaled_by is None and not opt._ampkit.stash and not opt._ampkit.masters_scaled
    # The next step is exactly a clean first step: bit for bit a model that never saw those
    # gradients, and (O5's fused SGD agreeing with torch's to the last bit or so) the reference.
    clean = copy.deepcopy(base)
    clean, clean_opt = init(clean, torch.optim.SGD(clean.parameters(), lr=0.1, momentum=0.9), level)
    for step in range(2):
        x, y = batch(step)
        loss = amp_step(model, opt, x, y)
        assert torch.equal(loss, amp_step(clean, clean_opt, x, y))
        torch.testing.assert_close(loss, ref.step(x, y), rtol=1e-6, atol=0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), clean.parameters()))
    for p, q in zip(model.parameters(), ref.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("release", ["zero_grad", "next backward"])
def test_half_grads_leave_the_model_at_unscale_and_are_freed_before_the_next_backward(release):
    """Moved into the masters, the half gradients are gone from the model at once, but their
    memory is released only at the next zero_grad or scale_loss backward (not just before
    the optimizer step, where the allocator would hand the pages back to the system)."""

    model = Net()
    model, opt = init(model, torch.optim.SGD(model.parameters(), lr=0.1), "O5")
    x, y = batch(0)
    with ampkit.scale_loss(loss_fn(model(x), y), opt) as scaled:
        scaled.backward()
        half = weakref.ref(model.fc1.weight.grad)
    assert model.fc1.weight.grad is None and half() is not None
    assert next(ampkit.master_params(opt)).grad.dtype == torch.float32
    opt.step()
    assert half() is not None
    if release == "zero_grad":
        opt.zero_grad()
    else:
        with ampkit.scale_loss(loss_fn(model(x), y), opt) as scaled:
            assert half() is None
            scaled.backward()
    assert half() is None


def poison_once(param):
    """Make ``param``'s next gradient inf (one-shot)."""
    armed = {"on": False}

    def hook(grad):
        if armed["on"]:
            armed["on"] = False
            return torch.full_like(grad, float("inf"))
        return grad

    param.register_hook(hook)
    return armed


@pytest.mark.parametrize("variant", ["default", "foreach", "fused"])
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_skipped_overflow_step_leaves_adam_state_bit_identical(level, variant):
    cls, kw = optimizer_kwargs("adam", variant)
    model = Net()
    model, opt = init(model, cls(model.parameters(), **kw), level)
    armed = poison_once(model.fc2.weight)
    for step in range(2):
        amp_step(model, opt, *batch(step))
    snap = {
        "params": [p.detach().clone() for p in model.parameters()],
        "masters": [m.detach().clone() for m in ampkit.master_params(opt)],
        "state": copy.deepcopy(opt.state_dict()["state"]),
    }
    scaler = current_run("t").scalers[0]
    scale = scaler.loss_scale()
    armed["on"] = True
    amp_step(model, opt, *batch(2))
    assert scaler.skipped_steps == 1
    assert scaler.loss_scale() == (scale / 2 if level == "O2" else scale)  # O5's static scale stays
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), snap["params"]))
    assert all(torch.equal(m, q) for m, q in zip(ampkit.master_params(opt), snap["masters"]))
    state = opt.state_dict()["state"]
    assert state.keys() == snap["state"].keys()
    for i in state:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[i][k], snap["state"][i][k]), (i, k)
    assert all(m.grad is None for m in ampkit.master_params(opt))
    amp_step(model, opt, *batch(3))  # training goes on
    assert all(opt.state[m]["step"].item() == 3 for m in ampkit.master_params(opt))
    assert not torch.equal(model.fc1.weight, snap["params"][0])


def test_two_optimizers_holding_one_parameter_share_its_master():
    model = Net()
    a = torch.optim.SGD(model.parameters(), lr=0.1)
    b = torch.optim.SGD(model.fc1.parameters(), lr=0.1)
    model, (a, b) = ampkit.initialize(model, [a, b], opt_level="O2", verbosity=0)
    assert a.param_groups[0]["params"][0] is b.param_groups[0]["params"][0]
    assert model._ampkit.masters[model.fc1.weight] is b.param_groups[0]["params"][0]


@pytest.mark.parametrize("level,master_weights,expect", [("O2", False, False), ("O3", True, True), ("O5", None, True)])
def test_master_weights_override(level, master_weights, expect):
    model = Net()
    model, opt = init(model, torch.optim.SGD(model.parameters(), lr=0.1), level, master_weights=master_weights)
    params = list(ampkit.master_params(opt))
    assert (params[0] is not model.fc1.weight) == expect
    assert params[0].dtype == (torch.float32 if expect else model.fc1.weight.dtype)
    before = model.fc1.weight.detach().clone()
    amp_step(model, opt, *batch(0))
    assert not torch.equal(model.fc1.weight, before)
    if expect:
        assert torch.equal(model.fc1.weight, params[0].to(model.fc1.weight.dtype))


@pytest.mark.parametrize("created", ["before", "after"])
def test_lr_scheduler_keeps_working_without_warnings(created, recwarn):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.8)
    if created == "before":
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model, opt = init(model, opt, "O2")
    if created == "after":
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    armed = poison_once(model.fc1.weight)
    armed["on"] = True  # the very first step is skipped: the scheduler must not mind
    for step in range(3):
        amp_step(model, opt, *batch(step))
        sched.step()
    assert current_run("t").scalers[0].skipped_steps == 1
    assert opt.param_groups[0]["lr"] == 0.1
    assert not [w for w in recwarn.list if "lr_scheduler" in str(w.message) or "optimizer.step()" in str(w.message)]
