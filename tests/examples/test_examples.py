"""Smoke tests: every example script runs with tiny sizes and does what it says.

Each runs in a subprocess (one torch thread, so parallel test runs don't oversubscribe
the cores) in a temporary directory; nothing here measures time.
"""
import ast
import difflib
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.repo_files("examples")]  # real processes

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def run(script, *args, cwd):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def losses(out, word="loss"):
    values = [float(v) for v in re.findall(rf"\b{word}:? ([-+]?(?:\d[\d.]*(?:e[-+]?\d+)?|nan|inf))", out)]
    assert values and all(math.isfinite(v) for v in values), out
    return values


def test_simple(tmp_path):
    out = run("simple/train.py", "--opt-level", "O5", "--steps", "30", "--batch-size", "32", cwd=tmp_path)
    seen = losses(out)
    assert seen[-1] < 0.8 * seen[0]


def test_imagenet_resume_matches_uninterrupted_run(tmp_path):
    common = ["--opt-level", "O2", "--keep-batchnorm-fp32", "True", "--loss-scale", "dynamic", "--batch-size", "8",
              "--image-size", "16", "--width", "8", "--classes", "10", "--print-freq", "1"]
    straight = run("imagenet/main_amp.py", *common, "--steps", "4", cwd=tmp_path)
    first = run("imagenet/main_amp.py", *common, "--steps", "2", "--checkpoint", "ckpt.pt", cwd=tmp_path)
    assert (tmp_path / "ckpt.pt").exists() and "saved ckpt.pt" in first
    resumed = run("imagenet/main_amp.py", *common, "--steps", "4", "--resume", "ckpt.pt", cwd=tmp_path)
    assert "at step 2" in resumed
    final = lambda out: re.search(r"final loss (\S+)", out).group(1)
    assert final(resumed) == final(straight)  # bit-identical on CPU
    losses(straight)
    assert re.search(r"loss scale (\d+)", straight)  # the dynamic scaler is reported


def test_dcgan_three_losses(tmp_path):
    out = run("dcgan/main_amp.py", "--steps", "4", "--batch-size", "8", "--ngf", "8", "--ndf", "8", "--print-freq", "1", cwd=tmp_path)
    losses(out, "Loss_D")
    losses(out, "Loss_G")
    scalers = ast.literal_eval(out.split("loss scalers:", 1)[1].strip())
    assert sorted(scalers) == ["loss_scaler0", "loss_scaler1", "loss_scaler2"]
    assert all(s["unskipped"] == 4 for s in scalers.values())


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_finetune_frozen_bn(tmp_path, level):
    out = run("finetune_frozen_bn/finetune.py", "--opt-level", level, "--steps", "21", "--image-size", "16", cwd=tmp_path)
    assert "BatchNorm: torch.float32" in out and "BatchNorm in training mode: False" in out
    assert "BatchNorm running statistics unchanged: True" in out
    seen = losses(out)
    assert seen[-1] < seen[0]


def test_transformer_lpln(tmp_path):
    out = run("transformer_lpln/train.py", "--steps", "21", "--batch-size", "8", "--seq-len", "32", "--d-model", "64", cwd=tmp_path)
    norms = re.search(r"LayerNorm outputs on the first step: (.*)", out).group(1)
    assert "LPLayerNorm -> torch.bfloat16" in norms and "float32" not in norms
    seen = losses(out)
    assert seen[-1] < seen[0]


def test_migrate_from_apex(tmp_path):
    folder = EXAMPLES / "migrate_from_apex"
    before = (folder / "train_apex.py").read_text().splitlines(keepends=True)
    after = (folder / "train_ampkit.py").read_text().splitlines(keepends=True)
    diff = "".join(difflib.unified_diff(before, after, "a/train_apex.py", "b/train_ampkit.py"))
    assert diff == (folder / "apex_to_ampkit.diff").read_text()
    changed = [line for line in diff.splitlines()[2:] if line[:1] in "+-"]
    assert changed == ["-from apex import amp", "-from apex.normalization import FusedLayerNorm",
                       "+import ampkit as amp", "+from ampkit.normalization import FusedLayerNorm"]
    out = run("migrate_from_apex/train_ampkit.py", "--steps", "41", "--checkpoint", "ckpt.pt", cwd=tmp_path)
    seen = losses(out)
    assert seen[-1] < 0.5 * seen[0]
    assert sorted(torch.load(tmp_path / "ckpt.pt")) == ["amp", "model", "optimizer"]
