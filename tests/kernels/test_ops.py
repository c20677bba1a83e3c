"""The declared ops' call (``ampkit/_kernels/ops.py``, `_run`): through the dispatcher where a mode
may see it, the CPU implementation directly otherwise, with the same bits either way."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ampkit._kernels import ops
from ampkit._kernels.fused_sgd import Hyper

HYPER = Hyper(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=False, maximize=False)


class _Seen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _steps():
    """A master with its bf16 weight and a float32 parameter without one (`ops._weights`)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(37, generator=g), torch.randn(5, 3, generator=g)
    return [(x, torch.randn(37, generator=g), torch.randn(37, generator=g), False, x.bfloat16()),
            (y, torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g), False, None)]


def test_a_dispatch_mode_sees_the_op_and_both_ways_give_the_same_bits(lib, monkeypatch):
    calls = []
    real = ops._IMPLS["sgd_master"]
    monkeypatch.setitem(ops._IMPLS, "sgd_master", lambda *a: (calls.append(1), real(*a))[1])
    direct, seen = _steps(), _steps()
    ops.sgd_master_steps_(direct, HYPER)
    assert calls == [1]  # the implementation, called directly (the dispatcher's own is `real`)
    with _Seen() as mode:
        ops.sgd_master_steps_(seen, HYPER)
    assert mode.ops == ["ampkit.sgd_master.default"] and calls == [1]
    for a, b in zip(direct, seen):
        assert all(torch.equal(s, t) for s, t in zip(a, b) if torch.is_tensor(s))
    assert direct[0][4].float().sub(direct[0][0]).abs().max() < 1e-2  # the master's weight written
    assert not torch.equal(direct[1][0], _steps()[1][0])  # the float32 parameter stepped


def test_a_float32_parameter_beside_masters_steps_as_alone(lib):
    """`ops._weights`: one call for a master and a float32 parameter, each as its own call."""
    together, alone = _steps(), _steps()
    ops.sgd_master_steps_(together, HYPER)
    for step in alone:
        ops.sgd_master_steps_([step], HYPER)
    for a, b in zip(together, alone):
        assert all(torch.equal(s, t) for s, t in zip(a, b) if torch.is_tensor(s))


def test_the_profiler_sees_the_op(lib):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ops.sgd_master_steps_(_steps(), HYPER)
    assert [e.name for e in prof.events()].count("ampkit::sgd_master") == 1
