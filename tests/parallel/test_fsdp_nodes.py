"""examples/fsdp/train.py on two "nodes": two torchrun launchers with ``--nnodes 2
--nproc-per-node 2`` and a c10d rendezvous on 127.0.0.1, against one launcher with 4 processes."""
import pytest
import torch

from ._launch import torchrun_example, torchrun_nodes

pytestmark = [pytest.mark.slow, pytest.mark.repo_files("examples")]  # real processes

ARGS = ("--opt-level", "O7", "--steps", 3, "--batch-size", 2, "--d-model", 32, "--layers", 1)


def _losses(output):
    return [line for line in output.splitlines() if line.startswith("step ")]


def test_two_launchers_of_two_train_as_one_launcher_of_four(tmp_path):
    nodes = torchrun_nodes("fsdp/train.py", *ARGS, "--export", tmp_path / "nodes.pt", nnodes=2, nproc=2)
    one = torchrun_example("fsdp/train.py", *ARGS, "--export", tmp_path / "one.pt", nproc=4)
    printed = [_losses(out) for out in nodes]
    assert sorted(map(len, printed)) == [0, 2]  # global rank 0 prints, on whichever launcher holds it
    assert sum(printed, []) == _losses(one)
    got, want = torch.load(tmp_path / "nodes.pt", weights_only=True), torch.load(tmp_path / "one.pt", weights_only=True)
    assert got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())
