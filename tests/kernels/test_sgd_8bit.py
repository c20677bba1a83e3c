"""O8's SGD kernel with an 8-bit momentum buffer equals its eager reference bit for bit: odd sizes,
blocks cut by ``first`` (FSDP2 shards starting inside a block), strided and empty tensors, first and
later steps, 1 or 2 threads, NaN codes, and steps that would write non-finite weights (nothing
written); the reference is torch's SGD arithmetic on the widened buffer."""
import pytest
import torch

from ampkit._kernels import native
from ampkit._kernels.blockquant import NAN_INT8, dequantize, quantize_
from ampkit._kernels.fused_adamw_8bit import BLOCK, span
from ampkit._kernels.fused_sgd import Hyper
from ampkit._kernels.fused_sgd_8bit import backups, step_, steps_
from ampkit._kernels.rounding import round_counter_
from tests.kernels._eight_bit import (assert_kernel_equals_reference, assert_pieces_step_as_the_whole,
                                     assert_steps_stop_at_the_first_bad, assert_threads_and_strides_agree, same)

HYPERS = [Hyper(0.1, 0.9, 0.0, 5e-4, False, False),  # the ImageNet recipe
          Hyper(3e-2, 0.8, 0.0, 1e-2, True, True)]  # Nesterov (dampening 0, as torch requires), maximize
DAMPED = Hyper(3e-2, 0.7, 0.3, 0.0, False, False)


def tensors(n: int, first: int = 0, seed: int = 0) -> list:
    """``[w, grad, buffer codes, buffer scales]`` with the blocks of ``first``."""
    g = torch.Generator().manual_seed(seed)
    lead = first % BLOCK
    w, grad = torch.randn(n, generator=g).bfloat16(), (torch.randn(n, generator=g) * 1e-2).bfloat16()
    buf = torch.cat([torch.zeros(lead), torch.randn(n, generator=g) * 1e-2])
    q, s = torch.empty(lead + n, dtype=torch.int8), torch.empty(span(n, first))
    quantize_(q, s, buf, None, BLOCK)
    return [w, grad, q[lead:].clone(), s]


def test_a_step_is_torchs_sgd_on_the_widened_buffer_rounded_with_the_counter_bits():
    """Independently of the reference: SGD's formulas on the widened buffer, one rounding per
    operation, the weight rounded with the paired bits (two elements to a counter word); the new
    buffer stored as one of its two neighbouring codes."""
    n = 1000
    w, grad, q, s = tensors(n)
    buf = dequantize(q, s, torch.empty(n), BLOCK)
    hyper = HYPERS[0]
    g = grad.float() + w.float() * torch.tensor(hyper.weight_decay)
    b = buf * hyper.momentum + g * (1 - hyper.dampening)
    p = w.float() - b * hyper.lr
    want = torch.empty(n, dtype=torch.bfloat16)
    round_counter_(want, p, 4, 7, 2, 0, 0, paired=True)
    assert step_(w, grad, q, s, hyper, False, 4, 7, 2, 0, lib=None)
    assert torch.equal(w, want)
    stored = dequantize(q, s, torch.empty(n), BLOCK)
    step = s.repeat_interleave(BLOCK)[:n]
    assert ((stored - b).abs() <= step).all()  # one of the two neighbouring codes


@pytest.mark.parametrize("new", [True, False])
@pytest.mark.parametrize("hyper", HYPERS + [DAMPED])
@pytest.mark.parametrize("n,first", [(0, 0), (1, 0), (7, 3), (1001, 0), (1001, 100), (300, 255),
                                     (3 * native.MIN_PER_THREAD + 5, 513)])
def test_kernel_equals_the_eager_reference(lib, n, first, hyper, new):
    assert_kernel_equals_reference(lambda: tensors(n, first), lambda t, kernel: step_(*t, hyper, new, 5, 2, 1, first, lib=kernel),
                                   lib, moved=(0, 2))  # weights and codes


def test_the_first_step_ignores_the_old_codes(lib):
    """``new``: the buffer is the gradient (torch's first step), whatever the codes held."""
    a, b = tensors(600), tensors(600)
    b[2].fill_(NAN_INT8)
    for t in (a, b):
        assert step_(*t, HYPERS[0], True, 1, 1, 0, 0, lib=lib)
    assert same(a, b)


def test_non_contiguous_tensors_and_any_thread_count(lib):
    n, first = 2 * native.MIN_PER_THREAD + 3, 1000
    assert_threads_and_strides_agree(tensors(n, first), lambda t, kernel: step_(*t, HYPERS[0], False, 1, 2, 3, first, lib=kernel), lib)


@pytest.mark.parametrize("use_lib", [False, True])
def test_pieces_cut_at_block_boundaries_step_as_the_whole(lib, use_lib):
    assert_pieces_step_as_the_whole(
        tensors(1000), lambda t, first: step_(*t, HYPERS[0], False, 9, 4, 2, first, lib=lib if use_lib else None), (3,), BLOCK)


@pytest.mark.parametrize("use_lib", [False, True])
@pytest.mark.parametrize("case", ["nan_buffer", "weight_overflows"])
def test_a_step_with_a_non_finite_weight_writes_nothing(lib, use_lib, case):
    n, first = 2 * native.MIN_PER_THREAD + 3, 77
    t = tensors(n, first)
    hyper = HYPERS[0]
    if case == "nan_buffer":
        t[2][n - 5] = NAN_INT8
    else:
        t[0][n // 2], t[1][n // 2] = 3.3e38, -1.0
        hyper = Hyper(3e37, 0.9, 0.0, 0.0, False, False)
    before = [x.clone() for x in t]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert not step_(*t, hyper, False, 1, 1, 0, first, lib=lib if use_lib else None)
    finally:
        torch.set_num_threads(threads)
    assert same(before, t)


def test_shapes_are_checked():
    w, grad, q, s = tensors(300)
    with pytest.raises(ValueError, match="scales expected"):
        step_(w, grad, q, s[:1], HYPERS[0], False, 1, 1, 0, 0)


def test_the_declared_op_gives_the_kernels_bits(lib):
    """``ampkit::sgd_8bit`` (first and later steps) writes what `step_` writes and says how many wrote."""
    from ampkit._kernels import ops
    from ampkit._kernels.fused_sgd_8bit import backups

    n, first = 1000, 100
    ref = tensors(n, first)
    got = [t.clone() for t in ref]
    for new in (True, False):
        assert step_(*ref, HYPERS[1], new, 7, 3, 2, first, lib=lib)
        assert ops.sgd_8bit_steps_([(*got, new, 2, first, backups([(n, span(n, first))], {})[0])], HYPERS[1], 7, 3) == 1
    assert same(ref, got)
    got[2][5] = NAN_INT8
    assert ops.sgd_8bit_steps_([(*got, False, 2, first, backups([(n, span(n, first))], {})[0])], HYPERS[1], 7, 4) == 0


@pytest.mark.parametrize("bad", [None, 0, 2, 3, 4])
@pytest.mark.parametrize("use_lib", [False, True])
def test_several_tensors_step_in_turn_until_the_first_non_finite_weight(lib, use_lib, bad):
    """`steps_` (the op's several tensors: runs of contiguous ones in one kernel call, a strided one
    alone) writes each tensor's reference bits up to the first whose new weight is not finite (a
    NaN buffer code), says how many wrote, and leaves that one and the rest as they were."""
    def steps(items, kernel):
        return steps_([(*t, False, i, first, backups([(t[0].numel(), span(t[0].numel(), first))], {})[0])
                       for i, (t, first) in enumerate(items)], HYPERS[0], 5, 2, kernel)

    assert_steps_stop_at_the_first_bad(tensors, steps, lambda t, first, i: step_(*t, HYPERS[0], False, 5, 2, i, first),
                                       lib if use_lib else None, bad)
