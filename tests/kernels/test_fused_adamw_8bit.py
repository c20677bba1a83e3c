"""O8's fused AdamW kernel equals its eager reference bit for bit: odd sizes, blocks cut by
``first`` (FSDP2 shards starting inside a block), non-contiguous and empty tensors, 1 or 2
threads, NaN and inf codes, and steps that would write non-finite weights (nothing written)."""
import math

import pytest
import torch

from ampkit._kernels import native
from ampkit._kernels.blockquant import INF_UINT8, NAN_INT8, NAN_UINT8, dequantize, quantize_
from ampkit._kernels.fused_adamw import Hyper
from ampkit._kernels.fused_adamw_8bit import BLOCK, backups, span, step_, steps_
from tests.kernels._eight_bit import (assert_kernel_equals_reference, assert_pieces_step_as_the_whole,
                                     assert_steps_stop_at_the_first_bad, assert_threads_and_strides_agree, same)

HYPERS = [Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True, False, 3.0),  # AdamW
          Hyper(3e-2, 0.8, 0.99, 1e-6, 0.1, False, True, 1.0)]  # Adam with L2 decay, maximize
CAP = 2.5  # a bound on |m| / sqrt(v) that binds for some elements of tensors()


def tensors(n: int, first: int = 0, seed: int = 0) -> list:
    """``[w, grad, m codes, m scales, v codes, v scales]`` with the blocks of ``first``."""
    g = torch.Generator().manual_seed(seed)
    lead = first % BLOCK
    w, grad = torch.randn(n, generator=g).bfloat16(), (torch.randn(n, generator=g) * 1e-2).bfloat16()
    m = torch.cat([torch.zeros(lead), torch.randn(n, generator=g) * 1e-3])
    v = torch.cat([torch.zeros(lead), torch.rand(n, generator=g) * 1e-5])
    mq, vq = torch.empty(lead + n, dtype=torch.int8), torch.empty(lead + n, dtype=torch.uint8)
    ms, vs = torch.empty(span(n, first)), torch.empty(span(n, first))
    quantize_(mq, ms, m, None, BLOCK)
    quantize_(vq, vs, v.sqrt(), None, BLOCK)
    return [w, grad, mq[lead:].clone(), ms, vq[lead:].clone(), vs]


def test_span_counts_the_blocks_a_piece_touches():
    assert [span(n, first) for n, first in [(0, 5), (1, 0), (256, 0), (257, 0), (256, 1), (1, 255), (2, 255)]] == \
        [0, 1, 1, 2, 2, 1, 2]


@pytest.mark.parametrize("cap", [CAP, math.inf])
@pytest.mark.parametrize("hyper", HYPERS)
@pytest.mark.parametrize("n,first", [(0, 0), (1, 0), (7, 3), (1001, 0), (1001, 100), (300, 255),
                                     (3 * native.MIN_PER_THREAD + 5, 513)])
def test_kernel_equals_the_eager_reference(lib, n, first, hyper, cap):
    assert_kernel_equals_reference(lambda: tensors(n, first), lambda t, kernel: step_(*t, hyper, cap, 5, 2, 1, first, lib=kernel),
                                   lib, moved=(0, 2, 4))  # weights and both codes


def spread(n: int, seed: int = 0) -> list:
    """`tensors` whose gradients and moments span many decades within a block: codes of ``sqrt(v)``
    in e4m4's linear run (below ``2**-14`` of the scale) and int8 codes below 1, where the
    kernel rounds by other integer formulas than above."""
    g = torch.Generator().manual_seed(seed)
    decades = lambda k: torch.pow(10.0, -k * torch.rand(n, generator=g))  # noqa: E731
    w, grad = torch.randn(n, generator=g).bfloat16(), (torch.randn(n, generator=g) * 1e-2 * decades(6)).bfloat16()
    m, v = torch.randn(n, generator=g) * 1e-3 * decades(6), torch.rand(n, generator=g) * 1e-5 * decades(12)
    mq, vq, ms, vs = torch.empty(n, dtype=torch.int8), torch.empty(n, dtype=torch.uint8), torch.empty(span(n, 0)), \
        torch.empty(span(n, 0))
    quantize_(mq, ms, m, None, BLOCK)
    quantize_(vq, vs, v.sqrt(), None, BLOCK)
    return [w, grad, mq, ms, vq, vs]


@pytest.mark.parametrize("cap", [CAP, math.inf])
@pytest.mark.parametrize("seed", range(4))
def test_values_far_below_their_block_maximum_step_as_the_reference(lib, seed, cap):
    t = spread(4096, seed)
    root = dequantize(t[4], t[5], torch.empty(4096), BLOCK)
    assert (root < 2.0 ** -14 * t[5].repeat_interleave(BLOCK)).float().mean() > 0.1  # the linear run is in use
    assert_kernel_equals_reference(lambda: spread(4096, seed), lambda t, kernel: step_(*t, HYPERS[0], cap, 7, 3, 1, 0,
                                                                                       lib=kernel), lib, moved=(0, 2, 4))


def test_the_cap_binds_and_holds():
    """With a cap, every stored ``|m|`` is within ``cap * sqrt(v)`` of the stored values; without,
    some element of these tensors exceeds it (so the cap is what bounds them)."""
    stored = {}
    for cap in (CAP, math.inf):
        t = tensors(4096)
        step_(*t, HYPERS[0], cap, 1, 1, 0, 0)
        m = t[2].double() * t[3].double().repeat_interleave(BLOCK)
        root = dequantize(t[4], t[5], torch.empty(4096), BLOCK).double()
        stored[cap] = (m.abs() <= CAP * root * (1 + 1e-6)).all().item()
    assert stored[CAP] and not stored[math.inf]


def test_non_contiguous_tensors_and_any_thread_count(lib):
    """The eager reference, the kernel on one thread and on two, and on strided tensors: the
    same bits (ranges cut at block boundaries of the full index, here with first % 256 != 0)."""
    n, first = 2 * native.MIN_PER_THREAD + 3, 1000
    assert_threads_and_strides_agree(tensors(n, first), lambda t, kernel: step_(*t, HYPERS[0], CAP, 1, 2, 3, first, lib=kernel), lib)


@pytest.mark.parametrize("use_lib", [False, True])
def test_pieces_cut_at_block_boundaries_step_as_the_whole(lib, use_lib):
    """FSDP2 shards starting on block boundaries: each piece's codes and scales are the whole's."""
    assert_pieces_step_as_the_whole(
        tensors(1000), lambda t, first: step_(*t, HYPERS[0], CAP, 9, 4, 2, first, lib=lib if use_lib else None), (3, 5), BLOCK)


@pytest.mark.parametrize("use_lib", [False, True])
def test_an_infinite_second_moment_stays_in_its_element(lib, use_lib):
    """An element whose v code is inf: its update is 0 (``m / inf``), its v code stays inf and
    its m code is 0; its block's scales come from the other elements: kernel and reference
    agree bit for bit, and the other elements step as without it."""
    n, at = 700, 300
    plain, odd = tensors(n), tensors(n)
    odd[4][at] = INF_UINT8
    ref = [t.clone() for t in odd]
    assert step_(*ref, HYPERS[0], CAP, 3, 1, 0, 0, lib=None)
    assert step_(*odd, HYPERS[0], CAP, 3, 1, 0, 0, lib=lib if use_lib else None)
    assert same(ref, odd)
    w0 = tensors(n)[0]
    assert odd[4][at] == INF_UINT8 and odd[2][at] == 0 and odd[0][at] == (w0[at].float() * (1 - 1e-3 * 0.01)).bfloat16()
    step_(*plain, HYPERS[0], CAP, 3, 1, 0, 0)
    others = torch.arange(n) != at
    assert torch.equal(plain[0][others], odd[0][others])


@pytest.mark.parametrize("use_lib", [False, True])
@pytest.mark.parametrize("case", ["nan_m", "nan_v", "weight_overflows"])
def test_a_step_with_a_non_finite_weight_writes_nothing(lib, use_lib, case):
    """NaN codes (m: -128, v: 254) make the new weight NaN, and a weight near bfloat16's top
    with a huge step overflows: the step returns False and weights, codes and scales keep
    their bits (the kernel wrote and put back; the reference wrote nothing)."""
    n, first = 2 * native.MIN_PER_THREAD + 3, 77
    t = tensors(n, first)
    hyper = HYPERS[0]
    if case == "nan_m":
        t[2][n - 5] = NAN_INT8
    elif case == "nan_v":
        t[4][10] = NAN_UINT8
    else:
        t[0][n // 2] = 3.3e38
        t[1][n // 2] = -1.0
        hyper = Hyper(3e37, 0.9, 0.999, 1e-8, 0.0, True, False, 1.0)
    before = [x.clone() for x in t]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert not step_(*t, hyper, CAP, 1, 1, 0, first, lib=lib if use_lib else None)
    finally:
        torch.set_num_threads(threads)
    assert same(before, t)


@pytest.mark.parametrize("bad", [None, 0, 2, 3, 4])
@pytest.mark.parametrize("use_lib", [False, True])
def test_several_tensors_step_in_turn_until_the_first_non_finite_weight(lib, use_lib, bad):
    """`steps_` (the op's several tensors: runs of contiguous ones in one kernel call, a strided one
    alone) writes each tensor's reference bits up to the first whose new weight is not finite (a
    NaN m code), says how many wrote, and leaves that one and the rest as they were."""
    def steps(items, kernel):
        return steps_([(*t, HYPERS[0], CAP, i, first, backups([(t[0].numel(), span(t[0].numel(), first))], {})[0])
                       for i, (t, first) in enumerate(items)], 5, 2, kernel)

    assert_steps_stop_at_the_first_bad(tensors, steps, lambda t, first, i: step_(*t, HYPERS[0], CAP, 5, 2, i, first),
                                       lib if use_lib else None, bad)
