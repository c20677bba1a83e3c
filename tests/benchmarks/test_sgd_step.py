"""The sgd_step family (benchmarks/families/sgd_step.py) run with --quick: its rows, columns and
targets exist and its ratios are positive finite numbers; no timing value is asserted."""
import math
import os
from types import SimpleNamespace

import pytest
import torch

from ampkit._config.levels import OPT_LEVELS
from common import Log, QUICK
from families import sgd_step


@pytest.fixture(scope="module")
def ran():
    """The family's result, and ``AMPKIT_FUSED`` before and after it ran (it sets the switch every step)."""
    before = os.environ.get("AMPKIT_FUSED")
    out = sgd_step.run(QUICK, torch.device("cpu"), SimpleNamespace(quick=True, size="auto", threads=1), Log("sgd_step"))
    return out, before, os.environ.get("AMPKIT_FUSED")


@pytest.fixture(scope="module")
def result(ran):
    return ran[0]


def test_every_model_has_a_row_per_level_with_both_paths(result):
    levels = [n for n, (level, _) in sgd_step.LEVELS.items() if level in OPT_LEVELS]
    assert [(r["model"], r["level"]) for r in result["rows"]] == [(m, n) for m in sgd_step.MODELS for n in levels]
    for r in result["rows"]:
        for key in ("fused_ms", "eager_ms", "vs_O5", "eager_vs_O5", "fused_vs_eager"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["model"], r["level"], key)
        assert r["params"] > 0


def test_o5_is_its_own_reference(result):
    assert all(r["vs_O5"] == r["eager_vs_O5"] == 1.0 for r in result["rows"] if r["level"] == "O5")


def test_targets_name_each_model_and_level(result):
    names = [t["target"] for t in sgd_step.targets(result)]
    for model in sgd_step.MODELS:
        for level, limit in sgd_step.TARGETS.items():
            if sgd_step.LEVELS[level][0] in OPT_LEVELS:
                assert f"SGD step {model} {level} <= {limit:.2f}x O5" in names
        assert f"SGD step {model} O5 fused <= its eager step (AMPKIT_FUSED=0)" in names
    assert all(isinstance(t["met"], bool) for t in sgd_step.targets(result))


def test_report_prints_the_table(result):
    text = "\n".join(sgd_step.report(result))
    assert "fused / eager" in text and "eager vs O5 eager" in text


def test_the_fused_switch_is_put_back(ran):
    _, before, after = ran
    assert after == before
