"""The ``ampkit`` command: ``levels``, ``demo`` (tiny runs; nothing is timed) and argument errors."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ampkit._cli import cli, demo
from ampkit._config import levels as opt_levels

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_python_m_ampkit_levels():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "ampkit", "levels"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == opt_levels.format_table().strip()
    assert all(f"{lvl}: " in proc.stdout for lvl in opt_levels.OPT_LEVELS)


def test_levels_in_process(capsys):
    assert cli.main(["levels"]) == 0
    assert capsys.readouterr().out == opt_levels.format_table() + "\n"


@pytest.mark.parametrize("argv, message", [
    (["demo", "--levels", "O9"], "unknown opt level"),
    (["demo", "--levels", "01"], "did you mean 'O1'"),
    (["demo", "--steps", "0"], "expected a positive integer"),
    (["demo", "--model", "rnn"], "invalid choice"),
    (["demo", "--device", "nodevice"], "--device"),
    pytest.param(["demo", "--device", "cuda"], "CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available")),
    ([], "required"),
])
def test_bad_arguments(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_demo_table_and_json(tmp_path, capsys):
    path = tmp_path / "demo.json"
    assert cli.main(["demo", "--steps", "3", "--levels", "O0,O2,O5", "--device", "cpu", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "steps/s" in out and "held-out loss" in out and "loss scale" in out and "Recommended here: O" in out
    data = json.loads(path.read_text())
    assert data["machine"]["torch"] and data["machine"]["cores"] >= 1 and data["steps"] == 3
    rows = {(r["model"], r["level"]): r for r in data["rows"]}
    assert sorted(rows) == [(m, lvl) for m in ("cnn", "lm") for lvl in ("O0", "O2", "O5")]
    for r in rows.values():
        assert math.isfinite(r["first_loss"]) and math.isfinite(r["final_loss"])
        assert r["steps_per_s"] > 0 and r["peak_mib"] >= 0 and r["speedup"] > 0
        assert r["skipped_steps"] <= 3
    assert rows[("lm", "O0")]["speedup"] == 1.0
    assert (rows[("cnn", "O5")]["weights"], rows[("cnn", "O5")]["masters"]) == ("bf16+fp32", "fp32")  # BatchNorm fp32
    assert (rows[("lm", "O5")]["weights"], rows[("lm", "O5")]["compute"]) == ("bf16", "bf16")
    assert rows[("lm", "O0")]["loss_scale"] == 1.0 and rows[("lm", "O2")]["loss_scale"] <= 2.0**16
    assert rows[("lm", "O0")]["first_loss"] == pytest.approx(rows[("lm", "O5")]["first_loss"], rel=0.02)  # same init


def test_worker_errors_reach_the_parent():
    with pytest.raises(RuntimeError, match="unknown opt level"):
        demo.isolated(demo.train, "cnn", "O9", 1)


def test_demo_memory_levels_report_bytes_per_param(tmp_path, capsys, monkeypatch):
    from ampkit._model import float8

    path = tmp_path / "demo.json"
    levels = "O5,O6,O7" if float8.available() else "O5,O7"
    assert cli.main(["demo", "--steps", "2", "--levels", levels, "--model", "lm", "--device", "cpu", "--json", str(path)]) == 0
    assert "bytes/param" in capsys.readouterr().out
    rows = {r["level"]: r for r in json.loads(path.read_text())["rows"]}
    # SGD with momentum: O5 bf16 weights + fp32 masters + fp32 momentum; O7 bf16 weights + fp32 momentum
    assert rows["O5"]["bytes_per_param"] == pytest.approx(10.0) and rows["O7"]["bytes_per_param"] == pytest.approx(6.0)
    assert rows["O7"]["masters"] == "-" and rows["O7"]["weights"] == "bf16"
    if "O6" in rows:
        assert rows["O6"]["bytes_per_param"] == pytest.approx(10.0) and math.isfinite(rows["O6"]["final_loss"])
    monkeypatch.setattr(float8, "available", lambda: False)
    assert demo._installed(["O5", "O6"]) == ["O5"] and "left out O6: fp8 needs torchao" in capsys.readouterr().out
