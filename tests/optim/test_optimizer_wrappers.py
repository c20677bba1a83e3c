"""Optimizer wrappers (LARC and the like) whose methods have their own signatures."""
import pytest
import torch
from torch import nn

import ampkit
from ampkit._optim.optimizer_wrappers import unwrap


class VendoredLARC:
    """Apex's LARC as many repositories vendor it: ``zero_grad()`` takes no argument."""

    def __init__(self, optimizer):
        self.optim = optimizer

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    def zero_grad(self):
        self.optim.zero_grad()

    def add_param_group(self, group):
        self.optim.add_param_group(group)

    def step(self):
        return self.optim.step()


def test_a_wrapper_whose_zero_grad_takes_no_argument_trains():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = VendoredLARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    model, opt = ampkit.initialize(model, opt, opt_level="O2", verbosity=0)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is None for p in ampkit.master_params(opt))


# -- framework wrappers (Lightning's, Fabric's, accelerate's), imitated here without the frameworks --

class SubclassingWrapper:
    """As Lightning's LightningOptimizer and Fabric's _FabricOptimizer: a class made on the fly that
    subclasses the optimizer's class, the real one in ``_optimizer``, other attributes forwarded."""

    def __init__(self, optimizer):
        self._optimizer = optimizer
        self.__class__ = type("Wrapped" + type(optimizer).__name__, (SubclassingWrapper, type(optimizer)), {})

    def step(self, closure=None):
        return self._optimizer.step()

    def __getattr__(self, item):
        return getattr(self._optimizer, item)


class HoldingWrapper(torch.optim.Optimizer):
    """As accelerate's AcceleratedOptimizer: the real one in ``optimizer``, its groups and state shown."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    param_groups = property(lambda self: self.optimizer.param_groups)
    state = property(lambda self: self.optimizer.state)
    defaults = property(lambda self: self.optimizer.defaults)

    def zero_grad(self, set_to_none=None):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        return self.optimizer.step()


def _seeded(level, wrap=None, before=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if before:  # the framework wrapped it first, and initialize got the wrapper
        wrapped = wrap(opt)
        model, given = ampkit.initialize(model, wrapped, opt_level=level, verbosity=0)
        assert given is wrapped
        return model, wrapped
    model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0)
    return model, (wrap(opt) if wrap else opt)


def _train(model, opt, batches, drop=()):
    for i, (x, y) in enumerate(batches):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        try:
            with ampkit.scale_loss(loss, opt) as scaled:
                scaled.backward()
                if i in drop:
                    raise KeyboardInterrupt  # the batch is dropped after backward wrote scaled gradients
        except KeyboardInterrupt:
            continue
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("wrap", [SubclassingWrapper, HoldingWrapper])
@pytest.mark.parametrize("level", ["O2", "O5", "O7"])
@pytest.mark.parametrize("before", [False, True], ids=["wrapped-after", "wrapped-before"])
def test_a_framework_wrapper_trains_as_the_optimizer_it_holds_dropped_batches_too(wrap, level, before):
    torch.manual_seed(1)
    batches = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(5)]
    kept = [b for i, b in enumerate(batches) if i != 2]
    reference = _train(*_seeded(level), kept)
    got = _train(*_seeded(level, wrap, before), batches, drop={2})
    assert all(torch.equal(a, b) for a, b in zip(reference, got))
    model, opt = _seeded(level, wrap, before)
    assert ampkit.state_dict(optimizer=opt) == ampkit.state_dict(optimizer=unwrap(opt))
    assert ampkit.step_was_skipped(opt) is False
    assert [id(p) for p in ampkit.master_params(opt)] == [id(p) for p in ampkit.master_params(unwrap(opt))]


def test_unwrap_finds_the_optimizer_behind_nested_wrappers_and_leaves_others_alone():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    assert unwrap(HoldingWrapper(SubclassingWrapper(opt))) is opt
    assert unwrap(opt) is opt
    larc = VendoredLARC(opt)  # a wrapper with its own step (LARC's): ampkit steps through it, not around it
    assert unwrap(larc) is larc


def test_a_subclassing_wrappers_add_param_group_reaches_ampkits():
    model, opt = _seeded("O5", SubclassingWrapper)
    _train(model, opt, [(torch.randn(8, 4), torch.randn(8, 1))])  # the wrapper met ampkit in scale_loss
    extra = nn.Linear(2, 2)
    model.add_module("extra", extra)
    extra.to(torch.bfloat16)
    opt.add_param_group({"params": list(extra.parameters())})
    stepped = opt._optimizer.param_groups[-1]["params"]
    assert all(p.dtype == torch.float32 for p in stepped)  # fp32 masters, as the optimizer's own call makes
