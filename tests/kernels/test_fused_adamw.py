"""O7's AdamW op over a param group's tensors: one kernel call for those it reads where they are,
each tensor with the bits of its own step (`fused_adamw.step_`'s eager reference)."""
import dataclasses

import pytest
import torch

from ampkit._kernels import native, ops
from ampkit._kernels.fused_adamw import Hyper, step_

HYPER = Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True, False, 0.0)  # the op reads each tensor's step count
SIZES = [1001, 0, 7, 300, 2 * native.MIN_PER_THREAD + 3]  # the one at STRIDED is strided
STRIDED = 3


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def group(state: torch.dtype) -> list:
    """``[w, grad, m, v]`` of each size of `SIZES` (seeded)."""
    g = torch.Generator().manual_seed(0)
    return [[torch.randn(n, generator=g).bfloat16(), (torch.randn(n, generator=g) * 1e-2).bfloat16(),
             (torch.randn(n, generator=g) * 1e-3).to(state), (torch.rand(n, generator=g) * 1e-5).to(state)]
            for n in SIZES]


@pytest.mark.parametrize("state", [torch.float32, torch.bfloat16])
def test_a_groups_tensors_in_one_op_step_as_each_alone(lib, state):
    """Sizes odd, empty and past the two-thread cut, one tensor strided, step counts that differ:
    the op (one kernel call for the contiguous ones) writes each tensor's reference bits."""
    ref, got = group(state), group(state)
    got[STRIDED] = [torch.empty(2 * t.numel(), dtype=t.dtype)[::2].copy_(t) for t in got[STRIDED]]
    counts = [torch.tensor(float(3 + i)) for i in range(len(SIZES))]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        ops.adamw_steps_([(*t, c, i, 11 * i) for i, (t, c) in enumerate(zip(got, counts))], HYPER, 7, 4)
    finally:
        torch.set_num_threads(threads)
    for i, (t, c) in enumerate(zip(ref, counts)):
        step_(*t, dataclasses.replace(HYPER, step=c.item()), 7, 4, i, 11 * i)
    assert not got[STRIDED][0].is_contiguous()
    assert all(torch.equal(bits(a), bits(b)) for r, t in zip(ref, got) for a, b in zip(r, t))
    assert not torch.equal(ref[0][0], group(state)[0][0])  # it stepped
