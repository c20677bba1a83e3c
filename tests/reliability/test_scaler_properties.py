"""Property tests: the loss scaler against a reference model of its rules, and hysteresis
end to end through ``initialize(loss_scale_hysteresis=H)`` with injected faults."""
import math

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import ampkit
from ampkit._run.scaler import LossScaler

from ._harness import (
    FLT_MAX, FLT_TINY, Poison, ReferenceScaler, assert_unchanged, close, expected_scales, fixed_batch,
    make, scalers, train,
)

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])

pow2 = st.integers(-20, 40).map(lambda k: 2.0**k)
bounds = st.tuples(st.none() | pow2, pow2).filter(lambda b: b[0] is None or b[0] <= b[1])


@st.composite
def scaler_config(draw):
    lo, hi = draw(bounds)
    return dict(
        init=draw(pow2 | st.floats(1e-3, 1e9)),
        growth=draw(st.sampled_from([2.0]) | st.floats(1.01, 8.0)),
        backoff=draw(st.sampled_from([0.5]) | st.floats(0.01, 0.99)),
        interval=draw(st.integers(1, 8)),
        min_scale=lo,
        max_scale=hi,
        hysteresis=draw(st.integers(1, 4)),
    )


def _scaler(cfg, loss_scale="dynamic"):
    return LossScaler(
        loss_scale, init_scale=cfg["init"], growth_factor=cfg["growth"], backoff_factor=cfg["backoff"],
        growth_interval=cfg["interval"], min_loss_scale=cfg["min_scale"], max_loss_scale=cfg["max_scale"],
        hysteresis=cfg["hysteresis"],
    )


def _in_bounds(scale, cfg):
    lo = cfg["min_scale"] if cfg["min_scale"] is not None else FLT_TINY
    return max(lo, FLT_TINY) <= scale <= min(cfg["max_scale"], FLT_MAX) and math.isfinite(scale) and scale > 0


@settings(max_examples=150, **SETTINGS)
@given(cfg=scaler_config(), overflows=st.lists(st.booleans(), max_size=60))
def test_dynamic_scaler_follows_the_reference_rules(cfg, overflows):
    s = _scaler(cfg)
    ref = ReferenceScaler("dynamic", **cfg)
    assert close(s.loss_scale(), ref.scale) and _in_bounds(s.loss_scale(), cfg)
    for i, overflow in enumerate(overflows):
        assert s.update(overflow) is ref.step(overflow)  # True exactly when the step is skipped
        assert close(s.loss_scale(), ref.scale), (i, s.loss_scale(), ref.scale)
        assert _in_bounds(s.loss_scale(), cfg), (i, s.loss_scale())
        assert (s.unskipped, s.consecutive_overflows) == (ref.clean, ref.streak)
    assert s.skipped_steps == sum(overflows)


@settings(max_examples=60, **SETTINGS)
@given(cfg=scaler_config(), static=st.sampled_from([1.0, 128.0, 0.25, 2.0**20]),
       overflows=st.lists(st.booleans(), max_size=40))
def test_static_scaler_never_moves_but_always_skips(cfg, static, overflows):
    s = _scaler(cfg, loss_scale=static)
    for overflow in overflows:
        assert s.update(overflow) is overflow
        assert s.loss_scale() == static
    assert s.skipped_steps == sum(overflows)


@settings(max_examples=80, **SETTINGS)
@given(cfg=scaler_config(), overflows=st.lists(st.booleans(), min_size=1, max_size=40), data=st.data())
def test_state_dict_mid_run_resumes_the_same_sequence(cfg, overflows, data):
    cut = data.draw(st.integers(0, len(overflows)))
    a = _scaler(cfg)
    for o in overflows[:cut]:
        a.update(o)
    b = _scaler(cfg)
    b.load_state_dict(a.state_dict())
    for o in overflows[cut:]:
        a.update(o)
        b.update(o)
        assert a.loss_scale() == b.loss_scale() and a.unskipped == b.unskipped


@settings(max_examples=80, **SETTINGS)
@given(h=st.integers(1, 6), overflows=st.lists(st.booleans(), max_size=50))
def test_hysteresis_tolerates_h_minus_1_consecutive_overflows(h, overflows):
    """With hysteresis H the scale never backs off within the first H-1 overflows of a
    streak, backs off on the H-th and every later one, and every overflow is skipped."""
    s = LossScaler("dynamic", hysteresis=h, growth_interval=10**9)
    streak = 0
    for o in overflows:
        before = s.loss_scale()
        assert s.update(o) is o
        streak = streak + 1 if o else 0
        if o and streak >= h:
            assert s.loss_scale() == before * 0.5
        else:
            assert s.loss_scale() == before


@settings(max_examples=25, **SETTINGS)
@given(
    level=st.sampled_from(["O1", "O2"]),
    h=st.integers(1, 4),
    pattern=st.lists(st.sampled_from([None, None, "inf", "nan"]), min_size=1, max_size=10),
)
def test_hysteresis_end_to_end(level, h, pattern):
    torch.manual_seed(0)
    x, y = fixed_batch()
    model, opt = make("adamw")
    model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0, loss_scale_hysteresis=h,
                                   max_loss_scale=2.0**17)  # no natural fp16 overflow
    for sc in scalers():
        sc.growth_interval = 2
    schedule = {(i, 0): kind for i, kind in enumerate(pattern) if kind}

    def on_step(step, poisoned, before, after):
        if poisoned:
            assert_unchanged(before, after, f"poisoned step {step}")

    seq = train(model, opt, x, y, len(pattern), schedule, poison=Poison(model.fc2.weight), on_step=on_step)
    expected, refs = expected_scales(schedule, len(pattern), 1, interval=2, hysteresis=h, max_scale=2.0**17)
    assert seq == expected
    assert scalers()[0].skipped_steps == len(schedule)  # only the injected faults
    state = ampkit.state_dict()["loss_scaler0"]
    assert state["loss_scale"] == refs[0].scale and state["unskipped"] == refs[0].clean
    if h > 1:
        assert state["consecutive_overflows"] == refs[0].streak
