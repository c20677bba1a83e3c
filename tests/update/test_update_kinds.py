"""One update class per ``Properties.update``: which one ``initialize`` attaches, and how it loads."""
import copy

import pytest
import torch
from torch import nn

import ampkit
from ampkit._config.levels import UpdateKind
from ampkit._initialize.apply import UPDATES
from ampkit._update.base import OptimizerUpdate
from ampkit._update.eight_bit import EightBitUpdate
from ampkit._update.masters import MastersUpdate
from ampkit._update.remainder import RemainderUpdate
from ampkit._update.rounded import RoundedUpdate


def prepared(level, opt=torch.optim.AdamW, **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    return ampkit.initialize(model, opt(model.parameters(), lr=1e-2), opt_level=level, verbosity=0, **options)


def one_step(model, opt):
    loss = model(torch.randn(4, 6)).float().pow(2).mean()
    with ampkit.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()


def test_every_kind_has_one_class():
    assert set(UPDATES) == set(UpdateKind)
    assert len(set(UPDATES.values())) == len(UpdateKind)


@pytest.mark.parametrize("level,options,cls", [
    ("O0", {}, OptimizerUpdate), ("O1", {}, OptimizerUpdate), ("O3", {}, OptimizerUpdate),
    ("O4", {}, OptimizerUpdate), ("O2", {}, MastersUpdate), ("O5", {}, MastersUpdate),
    ("O5", dict(master_weights="remainder"), RemainderUpdate),
    ("O5", dict(master_weights="remainder", optimizer_state_dtype=torch.bfloat16), RemainderUpdate),
    ("O7", {}, RoundedUpdate), ("O7", dict(optimizer_state_dtype=torch.bfloat16), RoundedUpdate),
    ("O7", dict(optimizer_state_dtype="8bit"), EightBitUpdate), ("O8", {}, EightBitUpdate),
    ("O8", dict(optimizer_state_dtype=torch.bfloat16), RoundedUpdate),
    ("O2", dict(master_weights=False, update_rounding="nearest"), RoundedUpdate),
    ("O7", dict(update_rounding=False), OptimizerUpdate),
])
def test_initialize_attaches_the_class_of_the_level_s_kind(level, options, cls):
    """The optimizer state holds it as ``.update``; torch's methods are not replaced for it."""
    model, opt = prepared(level, **options)
    update = opt._ampkit.update
    assert type(update) is cls and update.optimizer is opt and update.opt_state is opt._ampkit
    assert type(update) is UPDATES[opt._ampkit.run.properties.update]
    assert "load_state_dict" not in vars(opt)  # loads go through torch's load hooks
    chunked = cls in (RemainderUpdate, RoundedUpdate, EightBitUpdate)
    assert bool(opt._optimizer_load_state_dict_pre_hooks) is chunked
    assert bool(opt._optimizer_load_state_dict_post_hooks) is chunked
    one_step(model, opt)
    assert opt._ampkit.last_step_skipped is False and len(opt.state) == 4


@pytest.mark.parametrize("level,options", [("O7", {}), ("O8", {}), ("O5", dict(master_weights="remainder")),
                                           ("O7", dict(optimizer_state_dtype=torch.bfloat16))])
def test_a_load_torch_refuses_leaves_the_optimizer_and_the_dict_as_they_were(level, options):
    model, opt = prepared(level, **options)
    one_step(model, opt)
    saved = opt.state_dict()
    kept = copy.deepcopy(saved)
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {p: dict(opt.state[p]) for p in params}
    bad = dict(saved, param_groups=saved["param_groups"] * 2)
    with pytest.raises(ValueError, match="different number of parameter groups"):
        opt.load_state_dict(bad)
    assert [p for g in opt.param_groups for p in g["params"]] == params
    assert all(opt.state[p].keys() == state[p].keys() and all(opt.state[p][k] is v for k, v in state[p].items())
               for p in params)
    opt.load_state_dict(saved)  # the same dict loads after the refusal, and is not changed by loading
    assert saved.keys() == kept.keys() and saved["param_groups"] == kept["param_groups"]
    assert all(saved["state"][i].keys() == kept["state"][i].keys()
               and all(torch.equal(saved["state"][i][k], v) and saved["state"][i][k].dtype == v.dtype
                       for k, v in kept["state"][i].items()) for i in kept["state"])
    after = opt.state_dict()
    assert all(torch.equal(after["state"][i][k], v) for i in kept["state"] for k, v in kept["state"][i].items())


def test_loaded_float32_state_is_not_rounded_to_the_weights_dtype():
    """torch casts loaded state to its parameter's dtype; the half parameters' state comes back float32."""
    model, opt = prepared("O7")
    one_step(model, opt)
    saved = opt.state_dict()
    assert all(v.dtype == torch.float32 for st in saved["state"].values() for k, v in st.items() if k != "step")
    other_model, other = prepared("O7")
    other.load_state_dict(saved)
    for p in (p for g in other.param_groups for p in g["params"]):
        assert p.dtype == torch.bfloat16
        assert list(other.state[p]) == ["step", "exp_avg", "exp_avg_sq"]
        assert all(other.state[p][k].dtype == torch.float32 for k in ("exp_avg", "exp_avg_sq"))
    ours = other.state_dict()["state"]
    assert all(torch.equal(ours[i][k], v) for i, st in saved["state"].items() for k, v in st.items())
