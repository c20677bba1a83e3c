"""``install/overflow.py``: which devices a process group reduces on (the found-inf flag of
CPU-offloaded shards goes to the accelerator only when the group has no CPU backend)."""
import pytest

from ampkit.install.overflow import has_backend


@pytest.mark.parametrize("device_type, backends, expected", [
    ("cpu", "cuda:nccl", False),  # init_process_group("nccl"): a CPU flag must travel
    ("cuda", "cuda:nccl", True),
    ("cpu", "cpu:gloo,cuda:nccl", True),  # the mixed group torchtune and torchtitan use with CPU offload
    ("cpu", "cpu:gloo,cuda:gloo", True),  # init_process_group("gloo")
    ("xpu", "cpu:gloo,cuda:gloo", False),
])
def test_has_backend_reads_the_groups_backend_config(device_type, backends, expected):
    assert has_backend(device_type, backends) is expected
