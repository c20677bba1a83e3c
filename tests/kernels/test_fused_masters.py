"""AdamW on fp32 masters in one pass (O5's and remainder masters): the C kernels equal the eager
references bit for bit (odd, empty and non-contiguous tensors, 1 or 2 threads, shards, the
side table's rare values and its buffers filling up), a remainder master steps exactly as the
O5 master it holds, and bad arguments are refused before anything is written."""
import dataclasses

import pytest
import torch

from ampkit._kernels import native
from ampkit._kernels.fused_adamw import Hyper
from ampkit._kernels.fused_masters import RBLOCK, step_master_, step_remainder_
from ampkit._kernels.remainder import master, remainder, set_side_table, side_table

HYPERS = [Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True, False, 3.0),  # AdamW
          Hyper(3e-2, 0.8, 0.99, 1e-6, 0.1, False, True, 1.0)]  # Adam with L2 decay, maximize
SIZES = [0, 1, 7, 1001, 3 * native.MIN_PER_THREAD + 5]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same(a, b) -> bool:
    return all(x.dtype == y.dtype and torch.equal(bits(x), bits(y)) for x, y in zip(a, b))


def masters(n: int, seed: int = 0):
    """fp32 master, fp32 gradient, state m, v."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2,
            torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-5]


def held(x: torch.Tensor, grad: torch.Tensor, m, v):
    """The same master as remainder storage: bf16 weight, int16 remainder (with its table), the
    bf16 gradient, the state."""
    return [x.bfloat16(), remainder(x), grad.bfloat16(), m.clone(), v.clone()]


def clone(ts):
    out = [t.clone() for t in ts]
    for t, o in zip(ts, out):
        if t.dtype == torch.int16 and side_table(t).numel():
            set_side_table(o, side_table(t).clone())
    return out


@pytest.mark.parametrize("hyper", HYPERS)
@pytest.mark.parametrize("n", SIZES)
def test_master_kernel_equals_the_eager_reference(lib, n, hyper):
    for with_weight in (True, False):
        ref = masters(n) + ([torch.empty(n, dtype=torch.bfloat16)] if with_weight else [])
        got = clone(ref)
        step_master_(*ref[:4], hyper, *ref[4:], lib=None)
        step_master_(*got[:4], hyper, *got[4:], lib=lib)
        assert same(ref, got)
        if with_weight:
            assert torch.equal(ref[4], ref[0].bfloat16())  # the model weight: the master rounded to nearest even
        if n > 100:
            assert not torch.equal(ref[0], masters(n)[0]) and not torch.equal(ref[2], masters(n)[2])


@pytest.mark.parametrize("hyper", HYPERS)
@pytest.mark.parametrize("n", SIZES + [2_000_003])
def test_remainder_kernel_equals_the_eager_reference_and_o5s_master(lib, n, hyper):
    """Kernel and eager reference write the same weight, remainder, table and state; the master
    they hold is bit for bit the O5 master stepped from the same value with the widened gradient.
    (At two million elements the side tables are in use before and after the step.)"""
    x, grad, m, v = masters(n, seed=n)
    ref = held(x, grad, m, v)
    got = clone(ref)
    step_remainder_(*ref, hyper, lib=None)
    step_remainder_(*got, hyper, lib=lib)
    assert same(ref, got) and torch.equal(side_table(ref[1]), side_table(got[1]))
    o5 = [x.clone(), grad.bfloat16().float(), m.clone(), v.clone(), torch.empty(n, dtype=torch.bfloat16)]
    step_master_(*o5[:4], hyper, o5[4], lib=lib)
    assert same([master(got[0], got[1]), got[0], got[3], got[4]], [o5[0], o5[4], o5[2], o5[3]])
    if n > 10**6:
        assert side_table(remainder(x)).numel() > 0 and side_table(got[1]).numel() > 0


@pytest.mark.parametrize("kind", ["master", "remainder"])
def test_non_contiguous_tensors_and_any_thread_count(lib, kind):
    """The eager reference, the kernel on one thread and on two (two ranges), and the kernel on
    non-contiguous tensors (stepped through contiguous copies): the same bits."""
    n = 2 * native.MIN_PER_THREAD + 3
    x, grad, m, v = masters(n)
    base = [x, grad, m, v, x.bfloat16()] if kind == "master" else held(x, grad, m, v)
    fn = (lambda ts, h, lib: step_master_(*ts[:4], h, ts[4], lib=lib)) if kind == "master" else \
        (lambda ts, h, lib: step_remainder_(*ts, h, lib=lib))
    runs = {k: clone(base) for k in ("eager", "one", "two")}
    runs["strided"] = [torch.empty(n, 2, dtype=t.dtype)[:, 1].copy_(t) for t in base]  # stride 2
    if kind == "remainder":
        set_side_table(runs["strided"][1], side_table(base[1]).clone())
    assert not runs["strided"][0].is_contiguous()
    threads = torch.get_num_threads()
    try:
        fn(runs["eager"], HYPERS[0], None)
        for key, count in (("one", 1), ("two", 2), ("strided", 2)):
            torch.set_num_threads(count)
            fn(runs[key], HYPERS[0], lib)
    finally:
        torch.set_num_threads(threads)
    for key in ("one", "two", "strided"):
        assert same(runs["eager"], runs[key]), key
        if kind == "remainder":
            assert torch.equal(side_table(runs["eager"][1]), side_table(runs[key][1])), key


def patterns(n: int) -> torch.Tensor:
    """fp32 masters at the remainder's edge cases, cycling: 32767 ULPs above an even bf16 value
    (the side table's case), the ties 0x8000 above even and odd values, 0x7FFF above an odd one,
    +-0, a subnormal, +-inf, a value that rounds to bf16 inf, negative values."""
    cells = torch.tensor([0x3F807FFF, 0x3F808000, 0x3F818000, 0x3F817FFF, 0x00000000, 0x80000000, 0x00017FFF,
                          0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xBF807FFF, 0x40007FFF], dtype=torch.int64)
    return cells.repeat(n // len(cells) + 1)[:n].to(torch.int32).view(torch.float32).clone()


@pytest.mark.parametrize("n", [13, 3 * RBLOCK + 7, 3 * native.MIN_PER_THREAD + 1])
def test_side_table_at_the_edge_cases_and_when_its_buffers_fill(lib, n):
    """With lr = 0 a step keeps every master: the edge-case masters come back bit for bit from
    kernel and reference alike, and the new table lists exactly the elements 32767 above an
    even bf16 value. With 3 elements of 12 listed, the kernel's candidate buffers fill many
    times over and its calls resume where they stopped."""
    hyper = Hyper(0.0, 0.9, 0.999, 1e-8, 0.01, True, False, 2.0)
    x = patterns(n)
    grad, m, v = (torch.full((n,), 1e-3), torch.full((n,), 1e-4), torch.full((n,), 1e-6))
    ref = held(x, grad, m, v)
    got = clone(ref)
    step_remainder_(*ref, hyper, lib=None)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        step_remainder_(*got, hyper, lib=lib)
    finally:
        torch.set_num_threads(threads)
    assert same(ref, got) and torch.equal(side_table(ref[1]), side_table(got[1]))
    assert torch.equal(bits(master(got[0], got[1])), bits(x))
    xb = bits(x)
    expected = ((xb & 0x1FFFF) == 0x7FFF) & ((xb & 0x7FFFFFFF) < 0x7F800000)
    assert torch.equal(side_table(got[1]), expected.nonzero().flatten()) and expected.sum() > n // 12


def test_a_stale_or_unsorted_table_reads_as_combine_reads_it(lib):
    """A table entry whose pair no longer holds code 32766 of an even weight moves nothing, an
    unsorted table is read whole, and both paths agree."""
    hyper = HYPERS[0]
    x, grad, m, v = masters(5000, seed=4)
    x[[10, 2000, 4000]] = patterns(1)[0]  # listed for real
    ref = held(x, grad, m, v)
    table = torch.tensor([4000, 7, 2000, 10, 3333], dtype=torch.int64)  # 7 and 3333 stale
    set_side_table(ref[1], table)
    assert torch.equal(bits(master(ref[0], ref[1])), bits(x))
    got = clone(ref)
    step_remainder_(*ref, hyper, lib=None)
    step_remainder_(*got, hyper, lib=lib)
    assert same(ref, got) and torch.equal(side_table(ref[1]), side_table(got[1]))


@pytest.mark.parametrize("use_lib", [False, True])
def test_shards_step_as_the_whole_tensor(lib, use_lib):
    """A tensor stepped whole equals its pieces stepped on their own (FSDP2's shards of any
    world size, in one process): masters, weights, remainders, and the tables at their offsets."""
    n, cuts = 2_000_003, [0, 333_333, 333_334, 2_000_003]
    x, grad, m, v = masters(n, seed=n)
    whole = held(x, grad, m, v)
    step_remainder_(*whole, HYPERS[0], lib=lib if use_lib else None)
    tables = []
    for a, b in zip(cuts, cuts[1:]):
        piece = held(x[a:b], grad[a:b], m[a:b].clone(), v[a:b].clone())
        step_remainder_(*piece, HYPERS[0], lib=lib if use_lib else None)
        assert same(piece, [t[a:b] for t in whole])
        tables.append(side_table(piece[1]) + a)
    assert torch.equal(torch.cat(tables), side_table(whole[1])) and side_table(whole[1]).numel() > 0
    o5 = masters(n, seed=n)
    o5[1] = o5[1].bfloat16().float()
    step_master_(*o5, HYPERS[0], lib=lib if use_lib else None)
    piece = masters(n, seed=n)
    piece[1] = piece[1].bfloat16().float()
    for a, b in zip(cuts, cuts[1:]):
        step_master_(*(t[a:b] for t in piece), HYPERS[0], lib=lib if use_lib else None)
    assert same(o5, piece) and torch.equal(bits(o5[0]), bits(master(whole[0], whole[1])))


def test_bad_arguments_are_refused_before_anything_is_written(lib):
    x, grad, m, v = masters(10)
    before = clone([x, grad, m, v])
    with pytest.raises(TypeError, match="step_master_: grad must be a dense torch.float32 tensor"):
        step_master_(x, grad.bfloat16(), m, v, HYPERS[0], lib=lib)
    with pytest.raises(TypeError, match="w must be a dense torch.bfloat16"):
        step_master_(x, grad, m, v, HYPERS[0], torch.empty(10, dtype=torch.float16), lib=lib)
    with pytest.raises(ValueError, match="one shape"):
        step_master_(x, grad, m, v[:9], HYPERS[0], lib=lib)
    w, r, g16, m2, v2 = held(x, grad, m, v)
    with pytest.raises(TypeError, match="step_remainder_: r must be a dense torch.int16"):
        step_remainder_(w, r.int(), g16, m2, v2, HYPERS[0], lib=lib)
    assert same([x, grad, m, v], before) and same([w, r], held(x, grad, m, v)[:2])


@pytest.mark.parametrize("with_weights", [True, False])
def test_a_groups_masters_in_one_op_step_as_each_alone(lib, with_weights):
    """O5's op over a group (odd, empty and large masters, one strided, step counts that differ;
    bf16 model weights or none): each master, its state and weight get `step_master_`'s bits."""
    from ampkit._kernels import ops

    sizes = [1001, 0, 7, 2 * native.MIN_PER_THREAD + 3]
    ref = [masters(n, seed) + ([torch.empty(n, dtype=torch.bfloat16)] if with_weights else []) for seed, n in enumerate(sizes)]
    got = [[t.clone() for t in ts] for ts in ref]
    got[2] = [torch.empty(2 * t.numel(), dtype=t.dtype)[::2].copy_(t) for t in got[2]]
    counts = [torch.tensor(float(2 + i)) for i in range(len(sizes))]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        ops.master_steps_([(*t[:4], c, t[4] if with_weights else None) for t, c in zip(got, counts)], HYPERS[1])
    finally:
        torch.set_num_threads(threads)
    for t, c in zip(ref, counts):
        step_master_(*t[:4], dataclasses.replace(HYPERS[1], step=c.item()), t[4] if with_weights else None)
    assert all(same(r, g) for r, g in zip(ref, got))
    assert not torch.equal(ref[0][0], masters(sizes[0], 0)[0])


def test_a_groups_remainder_masters_in_one_op_step_as_each_alone(lib):
    """The remainder op over a group (two large masters whose side tables are in use before and
    after, an empty one, a strided one, step counts that differ): each weight, remainder, state and side
    table as `step_remainder_` gives it alone, each table owning only its entries."""
    from ampkit._kernels import ops

    sizes = [2_000_003, 0, 301, 2_000_001]
    ref = [held(*masters(n, seed)) for seed, n in enumerate(sizes)]
    got = [clone(ts) for ts in ref]
    got[2] = [torch.empty(2 * t.numel(), dtype=t.dtype)[::2].copy_(t) for t in got[2]]
    counts = [torch.tensor(float(2 + i)) for i in range(len(sizes))]
    ops.remainder_steps_([(*ts, c) for ts, c in zip(got, counts)], HYPERS[0])
    for ts, c in zip(ref, counts):
        step_remainder_(*ts, dataclasses.replace(HYPERS[0], step=c.item()), lib=None)
    assert all(same(r, g) and torch.equal(side_table(r[1]), side_table(g[1])) for r, g in zip(ref, got))
    for table in (side_table(got[0][1]), side_table(got[3][1])):  # two tables: each not a view of both
        assert table.numel() > 0 and table.untyped_storage().nbytes() == 8 * table.numel()


def test_a_group_whose_buffers_fill_steps_in_one_op_as_each_alone(lib):
    """Edge-case masters (3 of 12 listed: the candidate buffers fill and the calls resume) beside
    others in one op call, on two threads: each tensor's bits and table as the reference gives
    them alone (lr = 0: the listed masters stay listed)."""
    from ampkit._kernels import ops

    hyper = Hyper(0.0, 0.9, 0.999, 1e-8, 0.01, True, False, 2.0)
    sizes = [3 * native.MIN_PER_THREAD + 1, 1001, 3 * RBLOCK + 7]
    xs = [patterns(sizes[0]), masters(sizes[1], 1)[0], patterns(sizes[2])]
    ref = [held(x, torch.full((n,), 1e-3), torch.full((n,), 1e-4), torch.full((n,), 1e-6)) for x, n in zip(xs, sizes)]
    got = [clone(ts) for ts in ref]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        ops.remainder_steps_([(*ts, torch.tensor(3.0)) for ts in got], hyper)
    finally:
        torch.set_num_threads(threads)
    for ts in ref:
        step_remainder_(*ts, dataclasses.replace(hyper, step=3), lib=None)
    assert all(same(r, g) and torch.equal(side_table(r[1]), side_table(g[1])) for r, g in zip(ref, got))
    assert side_table(got[0][1]).numel() > sizes[0] // 12 and side_table(got[2][1]).numel() > sizes[2] // 12
