"""examples/fsdp/train.py under torchrun (``python -m torch.distributed.run``): 2 CPU processes,
a sharded checkpoint, a resume in new processes, and a float32 export."""
import pytest
import torch

from ._launch import torchrun_example

pytestmark = [pytest.mark.slow, pytest.mark.repo_files("examples")]  # real processes


def _torchrun(*args):
    return torchrun_example("fsdp/train.py", "--steps", 3, "--batch-size", 2, "--d-model", 32, *args)


def test_example_trains_checkpoints_resumes_and_exports(tmp_path):
    first = _torchrun("--opt-level", "O5", "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert "step    2  loss" in first and "saved a sharded checkpoint" in first
    second = _torchrun("--opt-level", "O5", "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume",
                       "--export", str(tmp_path / "model.pt"))
    assert "step    5  loss" in second
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert state and all(v.dtype == torch.float32 for v in state.values())
