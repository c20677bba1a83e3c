"""``amp._amp_state`` (Apex's spelling): read-only views of the current run's loss scalers
and options; removed handle API names fail with the ampkit call to use instead."""
import warnings

import pytest
import torch
from torch import nn

import ampkit
from ampkit._common.errors import NoEffectWarning


def _run(level, **kw):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return ampkit.initialize(model, opt, opt_level=level, verbosity=0, **kw)


def test_loss_scalers_reflect_the_run():
    model, opt = _run("O2", num_losses=2, min_loss_scale=4.0)
    state = ampkit._amp_state
    scalers = state.loss_scalers
    assert len(scalers) == 2
    assert scalers[0].loss_scale() == 2.0**16 == scalers[0]._loss_scale
    assert scalers[1]._unskipped == 0 and scalers[0].dynamic and scalers[0]._min_loss_scale == 4.0
    assert scalers[0]._max_loss_scale == 2.0**24 and scalers[0]._scale_seq_len == 2000
    x = torch.full((2, 4), 1e4)
    with ampkit.scale_loss(model(x).float().pow(4).sum(), opt, loss_id=1) as s:  # overflows in float16
        s.backward()
    opt.step()
    assert scalers[1].loss_scale() == 2.0**15 and scalers[0].loss_scale() == 2.0**16  # live views
    ampkit.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 3}, "loss_scaler1": {"loss_scale": 2.0, "unskipped": 0}})
    assert (state.loss_scalers[0]._loss_scale, state.loss_scalers[0]._unskipped) == (8.0, 3)
    assert state.loss_scalers[0].loss_scale() == ampkit.state_dict()["loss_scaler0"]["loss_scale"]
    scalers[0]._loss_scale = 2.0**10  # as Apex's own tests set it: through the load validation
    assert scalers[0].loss_scale() == 2.0**10 and ampkit.state_dict()["loss_scaler0"] == {"loss_scale": 1024.0, "unskipped": 3}
    with pytest.raises(ValueError, match=r"amp._amp_state.loss_scalers\[0\]\['loss_scale'\]=-1.0: expected a positive"):
        scalers[0]._loss_scale = -1.0
    assert scalers[0].loss_scale() == 2.0**10
    with pytest.raises(AttributeError, match="read-only.*assign _loss_scale or use ampkit.load_state_dict"):
        scalers[0]._unskipped = 5
    with pytest.raises(AttributeError, match="scale_loss"):
        scalers[0].update_scale()
    assert state.min_loss_scale == 4.0 and state.max_loss_scale == 2.0**24 and state.verbosity == 0


def test_opt_properties():
    _run("O5", loss_scale=128.0)
    props = ampkit._amp_state.opt_properties
    assert props.enabled and props.opt_level == "O5" and props.loss_scale == 128.0
    assert props.cast_model_type == torch.bfloat16 and props.master_weights is True and props.keep_batchnorm_fp32 is True
    assert props.options["opt_level"] == "O5"
    with pytest.raises(AttributeError, match="read-only.*ampkit.initialize"):
        props.loss_scale = 1.0
    with pytest.raises(AttributeError, match="no option 'nope'"):
        props.nope
    _run("O1", enabled=False)
    assert not ampkit._amp_state.opt_properties.enabled and ampkit._amp_state.loss_scalers == []


def test_flags_and_removed_api():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ampkit._amp_state.allow_incoming_model_not_fp32 = True
    assert ampkit._amp_state.allow_incoming_model_not_fp32 is True
    assert any(issubclass(x.category, NoEffectWarning) for x in w)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ampkit._amp_state.allow_incoming_model_not_fp32 = False
    with pytest.raises(AttributeError, match="ampkit.initialize"):
        ampkit.init()
    with pytest.raises(AttributeError, match="ampkit.initialize"):
        ampkit._amp_state.handle
    with pytest.raises(AttributeError, match="read-only"):
        ampkit._amp_state.loss_scalers = []
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        ampkit.nothing_here
