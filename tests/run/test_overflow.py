"""``_run/overflow.py``: which devices a process group reduces on (the found-inf flag of
CPU-offloaded shards goes to the accelerator only when the group has no CPU backend)."""
import pytest
import torch

from ampkit._run import overflow
from ampkit._run.overflow import device_for, has_backend


@pytest.mark.parametrize("device_type, backends, expected", [
    ("cpu", "cuda:nccl", False),  # init_process_group("nccl"): a CPU flag must travel
    ("cuda", "cuda:nccl", True),
    ("cpu", "cpu:gloo,cuda:nccl", True),  # the mixed group torchtune and torchtitan use with CPU offload
    ("cpu", "cpu:gloo,cuda:gloo", True),  # init_process_group("gloo")
    ("xpu", "cpu:gloo,cuda:gloo", False),
])
def test_has_backend_reads_the_groups_backend_config(device_type, backends, expected):
    assert has_backend(device_type, backends) is expected


CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("device, backends, accelerator, expected", [
    (CPU, "cuda:nccl", CUDA, CUDA),  # NCCL alone, CPU offload: through the accelerator
    (CPU, "cuda:nccl", None, CPU),  # no accelerator to go through: torch's own error on the CPU
    (CUDA, "cuda:nccl", CUDA, CUDA),
    (CPU, "cpu:gloo", CUDA, CPU),
    (CPU, "cpu:gloo", None, CPU),
    (CUDA, "cpu:gloo", CUDA, CUDA),  # the tensor is on the accelerator already
    (CPU, "cpu:gloo,cuda:nccl", CUDA, CPU),  # the mixed group keeps CPU tensors on gloo
    (CUDA, "cpu:gloo,cuda:nccl", CUDA, CUDA),
    (torch.device("cuda", 1), "cuda:nccl", torch.device("cuda", 1), torch.device("cuda", 1)),
])
def test_device_for_runs_a_collective_where_the_group_has_a_backend(device, backends, accelerator, expected):
    assert device_for(device, backends, accelerator) == expected


def test_collective_device_reads_the_given_groups_backend_config(monkeypatch):
    group, asked = object(), []
    configs = {None: "cpu:gloo,cuda:nccl", group: "cuda:nccl"}
    monkeypatch.setattr(torch.distributed, "get_backend_config", lambda g=None: asked.append(g) or configs[g])
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: CUDA)
    assert overflow.collective_device(CPU) == CPU
    assert overflow.collective_device(CPU, group) == CUDA
    assert asked == [None, group]
