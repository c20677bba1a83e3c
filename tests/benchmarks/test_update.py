"""The update family (benchmarks/families/update.py): its rows' table, and a --quick run of the
command whose JSON has every row or its reason for being skipped, the columns and the targets;
ratios are positive finite numbers, no timing value is asserted."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from families.update_variants import EAGER, TABLES, Variant, why_not

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
RATIOS = ("ms", "gbps", "vs_O5", "bound_ms", "vs_bound", "state_bytes")


@pytest.mark.parametrize("optimizer", list(TABLES))
def test_each_fused_level_row_has_its_eager_row_on_the_same_level(optimizer):
    table = TABLES[optimizer]
    for fused, eager in EAGER.items():
        a, b = table[fused], table[eager]
        assert (a.level, a.overrides, a.ideal) == (b.level, b.overrides, b.ideal) and a.fused and not b.fused


@pytest.mark.parametrize("optimizer", list(TABLES))
def test_every_row_moves_bytes_and_the_peers_train_bf16(optimizer):
    for name, v in TABLES[optimizer].items():
        assert v.ideal > 0 and (v.moved is None or v.moved >= v.ideal - 2), name  # a fused row may skip the model copy
        assert (v.level is None) == (v.make is not None), name
        if v.needs != "torch":
            assert v.dtype == torch.bfloat16, name


def test_a_row_whose_library_does_not_import_says_why():
    assert "does not import" in why_not(Variant(None, {}, True, 1, needs="ampkit_no_such_module"))
    assert "no level" in why_not(Variant("O99", {}, True, 1))


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    path = tmp_path_factory.mktemp("update") / "update.json"
    subprocess.run([sys.executable, "run.py", "--quick", "--only", "update", "--threads", "1", "--json", str(path)],
                   cwd=BENCHMARKS, check=True, capture_output=True, text=True, timeout=600)
    return json.loads(path.read_text())


@pytest.mark.slow
def test_every_level_ran_and_every_peer_ran_or_says_why_not(result):
    update = result["results"]["update"]
    for optimizer, table in TABLES.items():
        ran = [r["variant"] for r in update["rows"] if r["optimizer"] == optimizer]
        skipped = update["sections"][optimizer]["skipped"]
        assert sorted(ran + list(skipped)) == sorted(table) and all(isinstance(w, str) and w for w in skipped.values())
        assert [n for n in skipped if table[n].level is not None] == [], skipped  # only a peer may be skipped


@pytest.mark.slow
def test_rows_have_positive_finite_ratios(result):
    for r in result["results"]["update"]["rows"]:
        for key in RATIOS + (("vs_eager",) if r["variant"] in EAGER else ()):
            assert math.isfinite(r[key]) and r[key] > 0, (r["optimizer"], r["variant"], key)
        assert r["ideal_bytes"] > 0


@pytest.mark.slow
def test_targets_hold_both_optimizers_fused_against_eager(result):
    targets = [t["target"] for t in result["targets"]]
    for optimizer in TABLES:
        assert f"update {optimizer} O5 <= its eager path (AMPKIT_FUSED=0)" in targets
    assert "update O7 fused <= 1.5x its bound" in targets
    assert all(isinstance(t["met"], bool) for t in result["targets"])
