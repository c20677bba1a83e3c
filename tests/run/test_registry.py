"""The one rule for "the current run" (ampkit._run.registry), as every call without an optimizer sees it."""
import gc
import logging

import pytest
import torch
from torch import nn

import ampkit
from ampkit._run import registry


def build(level, seed=0, optimizer=True, **kw):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    if not optimizer:
        return ampkit.initialize(model, opt_level=level, verbosity=0, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return ampkit.initialize(model, opt, opt_level=level, verbosity=0, **kw)


def autocast_dtype():
    with ampkit.autocast():
        return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None


def test_a_teacher_initialized_later_never_takes_over_autocast():
    student, opt = build("O1")
    assert autocast_dtype() == torch.float16
    teacher = build("O4", seed=1, optimizer=False)  # bf16 autocast, no optimizer
    assert autocast_dtype() == torch.float16
    assert registry.current("t") is opt._ampkit.run and registry.of_model("t", teacher) is not opt._ampkit.run
    ema = build("O0", seed=2, optimizer=False)
    assert autocast_dtype() == torch.float16 and ema is not None


def test_without_a_training_run_the_latest_initialize_is_current():
    model = build("O4", optimizer=False)
    assert autocast_dtype() == torch.bfloat16
    assert registry.current("t") is registry.of_model("t", model)


def test_manual_seed_after_an_inference_only_initialize_reseeds_the_training_run():
    model, opt = build("O7")
    build("O5", seed=1, optimizer=False)
    ampkit.stochastic_rounding.manual_seed(5)
    assert opt._ampkit.run.rounder.seed == 5


def test_two_o7_runs_manual_seed_uses_the_newest_unless_told(caplog):
    m1, o1 = build("O7", seed=1)
    m2, o2 = build("O7", seed=2)
    with caplog.at_level(logging.WARNING, logger="ampkit"):
        ampkit.stochastic_rounding.manual_seed(7)
        ampkit.stochastic_rounding.manual_seed(8)
    assert o2._ampkit.run.rounder.seed == 8 and o1._ampkit.run.rounder.seed == 0
    assert sum("training runs" in r.getMessage() for r in caplog.records) == 1
    ampkit.stochastic_rounding.manual_seed(3, optimizer=o1)
    assert o1._ampkit.run.rounder.seed == 3 and o2._ampkit.run.rounder.seed == 8


def test_manual_seed_names_the_run_when_it_does_not_round():
    build("O5")
    with pytest.raises(RuntimeError, match=r"manual_seed\(\): run \d+ \(initialize at O5 with SGD\) does not round"):
        ampkit.stochastic_rounding.manual_seed(1)


def test_apex_amp_state_follows_the_current_run():
    model, opt = build("O2")
    ampkit.load_state_dict({"loss_scaler0": {"loss_scale": 128.0, "unskipped": 0}})
    build("O1", seed=1, optimizer=False, num_losses=3)
    views = ampkit._amp_state.loss_scalers
    assert len(views) == 1 and views[0].loss_scale() == 128.0
    assert ampkit._amp_state.opt_properties.opt_level == "O2"


def test_apex_resume_recipe_with_an_earlier_run_still_alive(caplog):
    old_model, old_opt = build("O2", seed=1)  # a sweep keeps its earlier models
    ckpt = {"amp": {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 3}}}
    model, opt = build("O2", seed=2)
    with caplog.at_level(logging.WARNING, logger="ampkit"):
        ampkit.load_state_dict(ckpt["amp"])  # Apex's recipe: amp.load_state_dict(checkpoint['amp'])
    assert ampkit.loss_scalers(opt)[0].loss_scale() == 1024.0
    assert ampkit.loss_scalers(old_opt)[0].loss_scale() == 2.0**16
    assert any("run " in r.getMessage() and "optimizer=" in r.getMessage() for r in caplog.records)


def test_a_run_ends_with_its_models():
    m1, o1 = build("O2", seed=1)
    m2, o2 = build("O5", seed=2)
    first = o1._ampkit.run
    del m2, o2
    gc.collect()
    assert registry.current("t") is first


def test_before_any_initialize_the_error_names_the_call(monkeypatch):
    monkeypatch.setattr(registry, "_latest", None)
    monkeypatch.setattr(registry, "_by_model", type(registry._by_model)())
    with pytest.raises(RuntimeError, match=r"ampkit.autocast\(\) was called before ampkit.initialize"):
        autocast_dtype()


def test_a_run_kept_only_by_a_reference_cycle_is_never_current(caplog):
    """The newer of two runs was current (and warned about); then it became garbage that only
    the cycle collector can free: the next call without optimizer= uses the live run."""
    old_model, old_opt = build("O2", seed=1)
    enabled = gc.isenabled()
    gc.disable()  # the cycle stays uncollected until ampkit looks
    try:
        model, opt = build("O2", seed=2)
        with caplog.at_level(logging.WARNING, logger="ampkit"):
            ampkit.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 0}})
        assert ampkit.loss_scalers(opt)[0].loss_scale() == 8.0 and any("run " in r.getMessage() for r in caplog.records)
        loop = [model, opt]
        loop.append(loop)
        del model, opt, loop
        ampkit.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 3}})
    finally:
        if enabled:
            gc.enable()
    assert ampkit.loss_scalers(old_opt)[0].loss_scale() == 1024.0
    assert registry.current("t") is old_opt._ampkit.run
