"""O6 / fp8: torchao Float8Linear in exactly the eligible nn.Linear layers; a clear error without torchao."""
import copy
import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit._model import float8

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
needs_torchao = pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed (pip install -e '.[fp8]')")


class MyLinear(nn.Linear):
    """A Linear subclass: its forward could be its own, so fp8 leaves it alone."""


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)  # eligible
        self.odd = nn.Linear(64, 40)  # 40 is not a multiple of 16
        self.back = nn.Linear(40, 64)  # 40 in
        self.sub = MyLinear(64, 64)  # a subclass
        self.blocks = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))  # eligible unless excluded
        self.head = nn.Linear(64, 32)  # the last Linear: the output head

    def forward(self, x):
        x = F.gelu(self.fc1(x))
        x = self.back(F.gelu(self.odd(x)))
        return self.head(self.blocks(self.sub(x)))


def make():
    torch.manual_seed(0)
    model = Net()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def converted(model):
    from torchao.float8.float8_linear import Float8Linear

    return sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))


def test_eligible_layers():
    assert float8.eligible(Net()) == ["fc1", "blocks.0", "blocks.1"]
    assert float8.eligible(Net(), ("blocks",)) == ["fc1"]
    assert float8.eligible(Net(), lambda name, m: name.endswith(".1")) == ["fc1", "blocks.0"]


@needs_torchao
@pytest.mark.parametrize("exclude, expected", [
    (None, ["blocks.0", "blocks.1", "fc1"]),
    (["blocks.1"], ["blocks.0", "fc1"]),
    (["blocks"], ["fc1"]),
    (lambda name, module: name == "fc1", ["blocks.0", "blocks.1"]),
])
def test_o6_converts_exactly_the_eligible_layers(exclude, expected):
    model, opt = make()
    params = list(model.parameters())
    model, opt = ampkit.initialize(model, opt, opt_level="O6", fp8_exclude=exclude, verbosity=0)
    assert converted(model) == expected
    assert list(model.parameters()) == params and all(p.dtype == torch.bfloat16 for p in params)  # same objects
    assert all(m.dtype == torch.float32 for m in opt._ampkit.masters.values()) and len(opt._ampkit.masters) == len(params)


@needs_torchao
@pytest.mark.parametrize("mode, device_has_fp8, emulate", [(True, True, False), (True, False, True), ("emulate", True, True)])
def test_emulated_only_where_needed(monkeypatch, mode, device_has_fp8, emulate):
    monkeypatch.setattr(float8, "has_fp8_matmul", lambda device: device_has_fp8)
    model, opt = make()
    model, opt = ampkit.initialize(model, opt, opt_level="O6", fp8=mode, verbosity=0)
    assert model.fc1.config.emulate is emulate


@needs_torchao
def test_o6_trains_like_torchao_on_an_o5_model_and_checkpoints_fp32():
    """O6 = O5 + torchao's conversion: the same losses as converting an O5 model by hand."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    x, y = torch.randn(8, 32), torch.randn(8, 32)
    runs = []
    for by_hand in (False, True):
        model, opt = make()
        model, opt = ampkit.initialize(model, opt, opt_level="O5" if by_hand else "O6", fp8="emulate" if not by_hand else None, verbosity=0)
        if by_hand:
            keep = {"fc1", "blocks.0", "blocks.1"}
            convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn in keep, config=Float8LinearConfig(emulate=True))
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            with ampkit.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            losses.append(loss.item())
        runs.append((model, losses))
    (model, losses), (_, by_hand) = runs
    assert losses == by_hand and losses[-1] < losses[0]
    sd = model.state_dict()
    plain = Net()
    assert sd.keys() == plain.state_dict().keys() and all(v.dtype == torch.float32 for v in sd.values())
    plain.load_state_dict(sd)
    assert torch.equal(plain.fc1.weight, model._ampkit.masters[model.fc1.weight])


def test_without_torchao_a_clear_error_naming_the_extra_and_nothing_changes(monkeypatch):
    for name in [n for n in sys.modules if n == "torchao" or n.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao now raises ImportError
    model, opt = make()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ImportError, match=r"pip install 'ampkit\[fp8\]'"):
        ampkit.initialize(model, opt, opt_level="O6", verbosity=0)
    with pytest.raises(ImportError, match=r"ampkit\[fp8\]"):
        ampkit.initialize(model, opt, opt_level="O5", fp8=True, verbosity=0)
    assert getattr(model, "_ampkit", None) is None and getattr(opt, "_ampkit", None) is None
    assert all(torch.equal(v, model.state_dict()[k]) and v.dtype == torch.float32 for k, v in before.items())


@needs_torchao
@pytest.mark.parametrize("exclude, exc, match", [
    (["nope"], ValueError, r"\['nope'\] name\(s\) no module"),
    ("fc1", TypeError, "expected a list of module names"),
    ([1], TypeError, "expected a list of module names"),
])
def test_bad_fp8_exclude_is_refused_before_anything_changes(exclude, exc, match):
    model, opt = make()
    with pytest.raises(exc, match=match):
        ampkit.initialize(model, opt, opt_level="O6", fp8_exclude=exclude, verbosity=0)
    assert getattr(model, "_ampkit", None) is None and all(p.dtype == torch.float32 for p in model.parameters())
    assert type(model.fc1) is nn.Linear


def test_fp8_exclude_without_fp8_is_a_no_effect_warning():
    model, opt = make()
    with pytest.warns(ampkit.NoEffectWarning, match="fp8_exclude"):
        ampkit.initialize(model, opt, opt_level="O5", fp8_exclude=["fc1"], verbosity=0)
