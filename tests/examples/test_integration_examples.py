"""The examples under examples/integrations/ run (each skips when its framework is absent) and train."""
import re

import pytest

from test_examples import losses, run  # tests/examples is on sys.path (no package), as pytest imports it

pytestmark = [pytest.mark.slow, pytest.mark.repo_files("examples/integrations")]


def first_and_final(out):
    first = float(re.search(r"first loss (\S+)", out).group(1))
    final = float(re.search(r"final loss (\S+)", out).group(1))
    return first, final


@pytest.mark.parametrize("level", ["O2", "O8"])
def test_lightning(level, tmp_path):
    pytest.importorskip("lightning", reason="needs lightning")
    out = run("integrations/lightning_train.py", "--opt-level", level, "--steps", "40", cwd=tmp_path)
    first, final = first_and_final(out)
    assert final < 0.5 * first
    assert re.search(r"loss scale \d+, skipped steps \d+", out)


@pytest.mark.parametrize("level", ["O7", "O2"])  # O2: its first steps overflow (loss scale 2^16) and are skipped
def test_fabric(tmp_path, level):
    pytest.importorskip("lightning", reason="needs lightning")
    out = run("integrations/fabric_train.py", "--opt-level", level, "--steps", "40", cwd=tmp_path)
    seen = losses(out)
    assert seen[-1] < 0.5 * seen[0]
    assert (tmp_path / "fabric.ckpt").exists()


def test_accelerate(tmp_path):
    pytest.importorskip("accelerate", reason="needs accelerate")
    out = run("integrations/accelerate_train.py", "--opt-level", "O8", "--steps", "40", cwd=tmp_path)
    seen = losses(out)
    assert seen[-1] < 0.5 * seen[0]
    assert "skipped False" in out
    assert any(p.name.startswith("custom_checkpoint") for p in (tmp_path / "accelerate_state").iterdir())


def test_transformers(tmp_path):
    pytest.importorskip("transformers", reason="needs transformers")
    out = run("integrations/transformers_train.py", "--opt-level", "O5", "--steps", "30", cwd=tmp_path)
    first, final = first_and_final(out)
    assert final < 0.5 * first
