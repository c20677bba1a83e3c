import math

import pytest
import torch

from ampkit._run.scaler import LossScaler


def test_dynamic_defaults_follow_apex():
    s = LossScaler("dynamic")
    assert (s.scale, s.growth_interval, s.growth_factor, s.backoff_factor, s.max_loss_scale) == (2.0**16, 2000, 2.0, 0.5, 2.0**24)


def test_dynamic_growth_and_backoff():
    s = LossScaler("dynamic", growth_interval=2)
    assert s.update(False) is False and s.scale == 2.0**16 and s.unskipped == 1
    assert s.update(False) is False and s.scale == 2.0**17 and s.unskipped == 0
    assert s.update(True) is True and s.scale == 2.0**16 and s.unskipped == 0
    assert s.skipped_steps == 1


def test_static_scale_skips_but_never_moves():
    s = LossScaler(128.0)
    assert s.update(True) is True and s.scale == 128.0
    for _ in range(5000):
        s.update(False)
    assert s.scale == 128.0 and s.skipped_steps == 1


def test_clamps_and_never_reaches_zero():
    s = LossScaler("dynamic", min_loss_scale=4.0, max_loss_scale=8.0, growth_interval=1)
    assert s.scale == 8.0
    s.update(False)
    assert s.scale == 8.0
    for _ in range(5):
        s.update(True)
    assert s.scale == 4.0 and s.at_floor
    free = LossScaler("dynamic")
    for _ in range(2000):
        free.update(True)
    assert free.scale > 0 and math.isfinite(free.scale)


def test_hysteresis_tolerates_h_minus_one_overflows():
    s = LossScaler("dynamic", hysteresis=3)
    s.update(True), s.update(True)
    assert s.scale == 2.0**16 and s.skipped_steps == 2
    s.update(True)
    assert s.scale == 2.0**15
    s.update(True)
    assert s.scale == 2.0**14  # still in the streak: every further overflow backs off
    s.update(False)
    s.update(True)
    assert s.scale == 2.0**14  # a clean step resets the streak


def test_state_dict_round_trip_and_validation():
    s = LossScaler("dynamic")
    s.update(False)
    assert s.state_dict() == {"loss_scale": 65536.0, "unskipped": 1}
    t = LossScaler("dynamic")
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    for bad in ({"loss_scale": -1.0, "unskipped": 0}, {"loss_scale": 1.0, "unskipped": -3}, {"loss_scale": 1.0}):
        with pytest.raises(ValueError, match="loss_scaler0"):
            LossScaler.check_state("loss_scaler0", bad)
