"""SGD with momentum on remainder masters in one pass: the C kernel equals the eager reference bit
for bit (every option, first and later steps, odd, empty and strided tensors, 1 or 2 threads, the
side table's rare values and its buffers filling up), and the master it holds is O5's fused SGD
master stepped from the same value, bit for bit."""
import itertools

import pytest
import torch

from ampkit._kernels import native
from ampkit._kernels.fused_masters import RBLOCK
from ampkit._kernels.fused_sgd import Hyper, step_master_
from ampkit._kernels.fused_sgd_remainder import step_
from ampkit._kernels.remainder import master, remainder, set_side_table, side_table

from .test_fused_masters import patterns

HYPERS = [Hyper(0.05, momentum, dampening, wd, nesterov, maximize)
          for momentum, dampening, wd, nesterov, maximize in itertools.product((0.0, 0.9), (0.0, 0.1), (0.0, 0.01),
                                                                               (False, True), (False, True))
          if not (nesterov and (momentum == 0 or dampening != 0))]  # torch's SGD refuses those
SIZES = [0, 1, 7, 1001, 3 * native.MIN_PER_THREAD + 5]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same(a, b) -> bool:
    return all((x is None and y is None) or (x.dtype == y.dtype and torch.equal(bits(x), bits(y))) for x, y in zip(a, b))


def held(x: torch.Tensor, grad: torch.Tensor, buf):
    """The master ``x`` as remainder storage (bf16 weight, int16 remainder with its table), the
    bf16 gradient, a copy of the buffer."""
    return [x.bfloat16(), remainder(x), grad.bfloat16(), None if buf is None else buf.clone()]


def masters(n: int, hyper: Hyper, seed: int = 0):
    """fp32 master, fp32 gradient, float32 buffer (None when momentum is 0)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2,
            None if hyper.momentum == 0 else torch.randn(n, generator=g) * 1e-2]


def clone(ts):
    out = [None if t is None else t.clone() for t in ts]
    if side_table(ts[1]).numel():
        set_side_table(out[1], side_table(ts[1]).clone())
    return out


def tables_equal(a, b) -> bool:
    return torch.equal(side_table(a[1]), side_table(b[1]))


@pytest.mark.parametrize("new", [True, False])
@pytest.mark.parametrize("hyper", HYPERS)
def test_kernel_equals_the_reference_and_o5s_fused_master_for_every_option(lib, hyper, new):
    n = 3 * RBLOCK + 11
    x, grad, buf = masters(n, hyper, seed=7)
    ref = held(x, grad, buf)
    got = clone(ref)
    step_(*ref, hyper, new, lib=None)
    step_(*got, hyper, new, lib=lib)
    assert same(ref, got) and tables_equal(ref, got)
    o5 = [x.clone(), grad.bfloat16().float(), None if buf is None else buf.clone(), torch.empty(n, dtype=torch.bfloat16)]
    step_master_(*o5[:3], hyper, new, o5[3], lib=lib)
    assert same([master(got[0], got[1]), got[0], got[3]], [o5[0], o5[3], o5[2]])


@pytest.mark.parametrize("n", SIZES + [2_000_003])
def test_every_size_and_later_steps_with_the_tables_in_use(lib, n):
    """Five steps (the buffer made on the first): kernel and reference write the same weights,
    remainders, tables and buffers at each, and at two million elements the tables are in use."""
    hyper = Hyper(1e-2, 0.9, 0.0, 0.01, True, False)
    x, grad, buf = masters(n, hyper, seed=n)
    ref = held(x, grad, buf)
    got = clone(ref)
    listed = 0
    for step in range(5):
        step_(*ref, hyper, step == 0, lib=None)
        step_(*got, hyper, step == 0, lib=lib)
        assert same(ref, got) and tables_equal(ref, got), step
        listed += side_table(got[1]).numel()
        ref[2] = got[2] = (grad * (step + 2)).bfloat16()
    assert listed > 0 or n < 10**6


def test_strided_tensors_and_one_or_two_threads(lib):
    n, hyper = 2 * native.MIN_PER_THREAD + 3, Hyper(0.05, 0.9, 0.1, 0.01, False, True)
    base = held(*masters(n, hyper))
    runs = {k: clone(base) for k in ("eager", "one", "two")}
    runs["strided"] = [torch.empty(n, 2, dtype=t.dtype)[:, 1].copy_(t) for t in base]
    set_side_table(runs["strided"][1], side_table(base[1]).clone())
    assert not runs["strided"][0].is_contiguous()
    threads = torch.get_num_threads()
    try:
        step_(*runs["eager"], hyper, False, lib=None)
        for key, count in (("one", 1), ("two", 2), ("strided", 2)):
            torch.set_num_threads(count)
            step_(*runs[key], hyper, False, lib=lib)
    finally:
        torch.set_num_threads(threads)
    for key in ("one", "two", "strided"):
        assert same(runs["eager"], runs[key]) and tables_equal(runs["eager"], runs[key]), key


@pytest.mark.parametrize("n", [13, 3 * RBLOCK + 7, 3 * native.MIN_PER_THREAD + 1])
def test_side_table_at_the_edge_cases_and_when_its_buffers_fill(lib, n):
    """With lr = 0 a step keeps every master: the edge-case masters come back bit for bit from
    kernel and reference alike and the new table lists exactly those 32767 above an even bf16
    value (3 elements of 12: the kernel's candidate buffers fill and its calls resume)."""
    hyper = Hyper(0.0, 0.9, 0.0, 0.0, False, False)
    x = patterns(n)
    ref = held(x, torch.full((n,), 1e-3), torch.full((n,), 1e-4))
    got = clone(ref)
    step_(*ref, hyper, False, lib=None)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        step_(*got, hyper, False, lib=lib)
    finally:
        torch.set_num_threads(threads)
    assert same(ref, got) and tables_equal(ref, got)
    assert torch.equal(bits(master(got[0], got[1])), bits(x))
    xb = bits(x)
    expected = ((xb & 0x1FFFF) == 0x7FFF) & ((xb & 0x7FFFFFFF) < 0x7F800000)
    assert torch.equal(side_table(got[1]), expected.nonzero().flatten()) and expected.sum() > n // 12
    table = side_table(got[1])
    assert table.untyped_storage().nbytes() == 8 * table.numel()  # its own storage, not the capture buffer


def test_a_stale_or_unsorted_table_reads_as_combine_reads_it(lib):
    hyper = Hyper(0.05, 0.9, 0.0, 0.0, False, False)
    x, grad, buf = masters(5000, hyper, seed=4)
    x[[10, 2000, 4000]] = patterns(1)[0]
    ref = held(x, grad, buf)
    set_side_table(ref[1], torch.tensor([4000, 7, 2000, 10, 3333], dtype=torch.int64))  # 7 and 3333 stale
    assert torch.equal(bits(master(ref[0], ref[1])), bits(x))
    got = clone(ref)
    step_(*ref, hyper, False, lib=None)
    step_(*got, hyper, False, lib=lib)
    assert same(ref, got) and tables_equal(ref, got)


def test_bad_arguments_are_refused_before_anything_is_written(lib):
    hyper = HYPERS[-1]
    w, r, grad, buf = held(*masters(10, Hyper(0.05, 0.9, 0.0, 0.0, False, False)))
    before = [t.clone() for t in (w, r, grad, buf)]
    with pytest.raises(TypeError, match="sgd remainder step_: buf must be a dense torch.float32"):
        step_(w, r, grad, buf.bfloat16(), hyper, False, lib=lib)
    with pytest.raises(TypeError, match="r must be a dense torch.int16"):
        step_(w, r.int(), grad, buf, hyper, False, lib=lib)
    with pytest.raises(ValueError, match="one shape"):
        step_(w, r, grad, buf[:9], hyper, False, lib=lib)
    assert same([w, r, grad, buf], before)


def test_the_declared_op_compiles_into_one_graph_with_the_eager_bits(lib):
    """``fullgraph=True`` (``aot_eager``; the side table is the op's argument and result, a size
    known only when it ran): five compiled steps, the first making the buffer, equal five eager
    ones, tables included."""
    from ampkit._kernels import ops
    hyper = Hyper(0.05, 0.9, 0.0, 0.01, True, False)

    def step(w, r, grad, buf, table, rstep):
        return torch.ops.ampkit.sgd_remainder([w], [r], [grad], [buf], [table], *ops._sgd_values(hyper), [rstep == 0])[0]

    x, grad, buf = masters(1000, hyper)
    x.view(torch.int32)[::100] = x.view(torch.int32)[::100] & ~0x1FFFF | 0x07FFF  # listed in the side table
    base = held(x, grad, buf) + [side_table(remainder(x)).clone()]
    assert base[4].numel() == 10
    runs = [base, [t.clone() for t in base]]
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        for rstep in range(5):
            for run, fn in zip(runs, (step, compiled)):
                run[4] = fn(*run, rstep)
    assert same(*runs) and not torch.equal(runs[1][0], x.bfloat16())


@pytest.mark.parametrize("hyper", [HYPERS[0], Hyper(0.05, 0.9, 0.1, 0.01, False, True)])  # no buffer; one
def test_a_groups_remainder_masters_in_one_op_step_as_each_alone(lib, hyper):
    """The remainder op over a group (two large masters whose side tables are in use, an empty one,
    a strided one; first and later steps): each weight, remainder, buffer and side table as `step_`
    gives it alone, each table owning only its entries."""
    from ampkit._kernels import ops

    sizes = [2_000_003, 0, 301, 2_000_001]
    ref = [held(*masters(n, hyper, seed)) for seed, n in enumerate(sizes)]
    got = [clone(ts) for ts in ref]
    got[2] = [None if t is None else torch.empty(2 * t.numel(), dtype=t.dtype)[::2].copy_(t) for t in got[2]]
    for new in (True, False):
        ops.sgd_remainder_steps_([(*ts, new) for ts in got], hyper)
        for ts in ref:
            step_(*ts, hyper, new, lib=None)
    assert all(same(r, g) and tables_equal(r, g) for r, g in zip(ref, got))
    for table in (side_table(got[0][1]), side_table(got[3][1])):  # two tables: each not a view of both
        assert table.numel() > 0 and table.untyped_storage().nbytes() == 8 * table.numel()


def test_a_group_whose_buffers_fill_steps_in_one_op_as_each_alone(lib):
    """Edge-case masters (their buffers fill, the calls resume) beside others in one op call, on
    two threads: each tensor's bits and table as the reference gives them alone."""
    from ampkit._kernels import ops

    hyper = Hyper(0.0, 0.9, 0.0, 0.0, False, False)
    sizes = [3 * native.MIN_PER_THREAD + 1, 1001, 3 * RBLOCK + 7]
    xs = [patterns(sizes[0]), masters(sizes[1], hyper, 1)[0], patterns(sizes[2])]
    ref = [held(x, torch.full((n,), 1e-3), torch.full((n,), 1e-4)) for x, n in zip(xs, sizes)]
    got = [clone(ts) for ts in ref]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        ops.sgd_remainder_steps_([(*ts, False) for ts in got], hyper)
    finally:
        torch.set_num_threads(threads)
    for ts in ref:
        step_(*ts, hyper, False, lib=None)
    assert all(same(r, g) and tables_equal(r, g) for r, g in zip(ref, got))
    assert side_table(got[0][1]).numel() > sizes[0] // 12 and side_table(got[2][1]).numel() > sizes[2] // 12
