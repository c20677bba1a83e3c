"""replace_module_classes: in-place replacement, counts, and optimizers that keep training the model."""
import pytest
import torch
from torch import nn

import ampkit
from ampkit.surgery import replace_module_classes


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2)))

    def forward(self, x):
        return self.body(self.fc(x))


def fresh_linear(module, name):
    """A new Linear with new Parameter objects holding the same values (and dtype)."""
    new = nn.Linear(module.in_features, module.out_features, dtype=module.weight.dtype)
    new.load_state_dict(module.state_dict())
    return new


class Scaled(nn.Module):
    """Wraps a module, reusing its Parameter objects."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return 2 * self.inner(x)


def step(model, opt, x):
    opt.zero_grad()
    model(x).square().sum().backward()
    opt.step()


def test_replaces_recursively_and_counts_per_class():
    model = Net()
    names = []
    counts = replace_module_classes(model, {nn.Linear: lambda m, n: names.append(n) or Scaled(m), nn.ReLU: lambda m, n: nn.GELU()})
    assert counts == {nn.Linear: 3, nn.ReLU: 1}
    assert names == ["fc", "body.0", "body.2.0"]
    assert type(model.fc) is Scaled and type(model.body[1]) is nn.GELU and type(model.body[2][0]) is Scaled
    assert type(model.fc.inner) is nn.Linear  # replacements are not searched again


def test_none_keeps_module_and_searches_its_children():
    model = Net()
    inner = model.body
    counts = replace_module_classes(model, {nn.Sequential: lambda m, n: None, nn.Linear: fresh_linear})
    assert counts == {nn.Linear: 3} and model.body is inner


def test_exact_class_match_and_root_untouched():
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(MyLinear(4, 4), nn.Linear(4, 4))
    assert replace_module_classes(model, {nn.Linear: fresh_linear}) == {nn.Linear: 1}
    assert type(model[0]) is MyLinear
    root = nn.Linear(2, 2)
    assert replace_module_classes(root, {nn.Linear: fresh_linear}) == {}


def test_shared_module_replaced_once_everywhere():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Sequential(shared))
    assert replace_module_classes(model, {nn.Linear: fresh_linear}) == {nn.Linear: 1}
    assert model[0] is model[1][0] and model[0] is not shared


def test_reused_parameters_stay_in_the_optimizer():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = list(model.parameters())
    replace_module_classes(model, {nn.Linear: lambda m, n: Scaled(m)})
    assert list(model.parameters()) == params
    w = model.fc.inner.weight.detach().clone()
    step(model, opt, torch.randn(3, 4))
    assert not torch.equal(model.fc.inner.weight, w)


@pytest.mark.parametrize("opt_cls,kw,keys", [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, ["momentum_buffer"]),
    (torch.optim.Adam, {"lr": 0.01}, ["step", "exp_avg", "exp_avg_sq"]),
])
def test_new_parameters_take_the_old_ones_place_with_their_state(opt_cls, kw, keys):
    model = Net()
    reference = Net()
    reference.load_state_dict(model.state_dict())
    opts = [opt_cls(model.parameters(), **kw), opt_cls(reference.parameters(), **kw)]
    x = torch.randn(3, 4)
    step(model, opts[0], x)
    step(reference, opts[1], x)
    old = dict(model.named_parameters())
    old_state = {n: opts[0].state[p] for n, p in old.items()}

    assert replace_module_classes(model, {nn.Linear: fresh_linear}, opts[0]) == {nn.Linear: 3}
    new = dict(model.named_parameters())
    held = [p for g in opts[0].param_groups for p in g["params"]]
    assert [id(p) for p in held] == [id(new[n]) for n in old] and all(new[n] is not old[n] for n in old)
    for n, p in new.items():
        assert old[n] not in opts[0].state and set(opts[0].state[p]) == set(keys)
        assert all(opts[0].state[p][k] is old_state[n][k] for k in keys)

    step(model, opts[0], x)
    step(reference, opts[1], x)
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, msg=n)  # same trajectory as without surgery


def test_list_of_optimizers():
    model = Net()
    opts = [torch.optim.SGD(model.fc.parameters(), lr=0.1), torch.optim.SGD(model.body.parameters(), lr=0.1)]
    replace_module_classes(model, {nn.Linear: fresh_linear}, opts)
    assert [p for g in opts[0].param_groups for p in g["params"]] == list(model.fc.parameters())
    assert [p for g in opts[1].param_groups for p in g["params"]] == list(model.body.parameters())


def test_policy_returning_non_module_is_a_type_error_and_changes_nothing():
    model = Net()
    fc = model.fc
    with pytest.raises(TypeError, match="ReLU"):
        replace_module_classes(model, {nn.Linear: fresh_linear, nn.ReLU: lambda m, n: torch.relu})
    assert model.fc is fc and type(model.body[1]) is nn.ReLU


def test_held_parameter_without_counterpart_is_an_error_and_changes_nothing():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fc = model.fc
    with pytest.raises(ValueError, match=r"fc\.bias"):
        replace_module_classes(model, {nn.Linear: lambda m, n: nn.Linear(4, m.out_features, bias=False)}, opt)
    assert model.fc is fc and opt.param_groups[0]["params"][1] is fc.bias
    # Without an optimizer holding it, dropping a parameter is fine.
    assert replace_module_classes(model, {nn.Linear: lambda m, n: nn.Linear(4, m.out_features, bias=False)}) == {nn.Linear: 3}


def test_bad_arguments():
    with pytest.raises(TypeError, match="policies"):
        replace_module_classes(Net(), {"Linear": fresh_linear})
    with pytest.raises(TypeError, match="optimizers"):
        replace_module_classes(Net(), {nn.Linear: fresh_linear}, optimizers="sgd")


def test_ampkit_optimizer_is_rebound_through_its_state():
    calls = []

    class FakeState:
        masters = {}

        def rebind(self, old, new):
            calls.append((old, new))

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt._ampkit = FakeState()
    groups = [list(g["params"]) for g in opt.param_groups]
    old = list(model.parameters())
    replace_module_classes(model, {nn.Linear: fresh_linear}, opt)
    assert [(id(o), id(n)) for o, n in calls] == [(id(o), id(n)) for o, n in zip(old, model.parameters())]
    assert [list(g["params"]) for g in opt.param_groups] == groups  # left to rebind


def test_surgery_after_initialize_keeps_master_weights():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampkit.initialize(model, opt, opt_level="O5", verbosity=0)
    masters = list(opt.param_groups[0]["params"])
    replace_module_classes(model, {nn.Linear: fresh_linear}, opt)
    new = list(model.parameters())
    assert list(opt.param_groups[0]["params"]) == masters
    assert [id(opt._ampkit.owner[m]) for m in masters] == [id(p) for p in new]
    before = model.fc.weight.detach().clone()
    with ampkit.scale_loss(model(torch.randn(3, 4)).float().square().sum(), opt) as loss:
        loss.backward()
    opt.step()
    assert not torch.equal(model.fc.weight, before)
    torch.testing.assert_close(model.fc.weight, masters[0].to(model.fc.weight.dtype), atol=0, rtol=0)
