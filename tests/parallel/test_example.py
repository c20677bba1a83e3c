"""examples/distributed/train.py under torchrun (``python -m torch.distributed.run``): 2 CPU processes."""
import pytest

from ._launch import torchrun_example

pytestmark = [pytest.mark.slow, pytest.mark.repo_files("examples")]  # real processes


def test_example_trains_under_torchrun():
    output = torchrun_example("distributed/train.py", "--opt-level", "O5", "--steps", "3", "--batch-size", "4")
    assert "step    2  loss" in output
