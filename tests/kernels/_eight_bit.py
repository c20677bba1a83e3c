"""What the tests of O8's kernels share: bit equality, and the runs that must give the same bits."""
import torch

from ampkit._kernels import native


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().view(-1)
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.uint8)


def same(a: list, b: list) -> bool:
    return all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b))


def assert_kernel_equals_reference(make, step, lib, moved: tuple) -> None:
    """``step(tensors, lib)`` on ``make()`` by the eager reference (``lib=None``) and by the kernel
    ``lib``: both write, the same bits; where a step has elements enough, the tensors at ``moved``
    differ from a fresh ``make()`` (it stepped)."""
    ref = make()
    got = [t.clone() for t in ref]
    assert step(ref, None)
    assert step(got, lib)
    assert same(ref, got)
    if ref[0].numel() > 100:
        fresh = make()
        assert all(not torch.equal(ref[i], fresh[i]) for i in moved)


def assert_threads_and_strides_agree(base: list, step, lib) -> None:
    """``step(tensors, lib)`` on copies of ``base``: the eager reference (``lib=None``), the kernel
    ``lib`` on one thread and on two, and on strided copies, the same bits."""
    runs = {k: [t.clone() for t in base] for k in ("eager", "one", "two")}
    runs["strided"] = [torch.empty(2 * t.numel(), dtype=t.dtype)[::2].copy_(t) for t in base]
    assert not runs["strided"][0].is_contiguous()
    threads = torch.get_num_threads()
    try:
        step(runs["eager"], None)
        for key, count in (("one", 1), ("two", 2), ("strided", 2)):
            torch.set_num_threads(count)
            step(runs[key], lib)
    finally:
        torch.set_num_threads(threads)
    for key in ("one", "two", "strided"):
        assert same(runs["eager"], runs[key]), key


def assert_pieces_step_as_the_whole(whole: list, step, scales: tuple, block: int) -> None:
    """``step(tensors, first)`` of ``whole`` (element 0 at 0) and of its pieces cut at block
    boundaries (the tensors at ``scales`` cut by block): the same bits."""
    pieces = [t.clone() for t in whole]
    n = whole[0].numel()
    step(whole, 0)
    for a, b in [(0, block), (block, 3 * block), (3 * block, n)]:
        step([t[a // block:-(-b // block)] if i in scales else t[a:b] for i, t in enumerate(pieces)], a)
    assert same(whole, pieces)



SIZES = [(1001, 100), (0, 0), (300, 255), (7, 3), (2 * native.MIN_PER_THREAD + 3, 513)]  # (n, first) of one call
STRIDED = 3  # the tensor whose weight is strided: the call's runs are the tensors before it, it, and those after


def strided(t: torch.Tensor) -> torch.Tensor:
    """Flat ``t``'s values in a non-contiguous tensor."""
    return torch.empty(2 * t.numel(), dtype=t.dtype)[::2].copy_(t)


def assert_steps_stop_at_the_first_bad(make, steps, one, lib, bad) -> None:
    """``steps(items, lib)`` (the tensors of `SIZES` from ``make(n, first, seed)`` in one call, as
    ``(tensors, first)``, tensor ``i`` the i-th; weight `STRIDED` strided) writes what ``one(tensors,
    first, i)`` (the eager reference) writes for each tensor before ``bad`` (None: all), says how many,
    and stops there: the tensor ``bad`` (its last code, ``tensors[2]``, made NaN: a non-finite new
    weight) and those after it keep their bits. On two threads, so that the large tensor's ranges run
    in parallel."""
    made = [make(n, first, seed) for seed, (n, first) in enumerate(SIZES)]
    if bad is not None:
        made[bad][2][-1] = -128  # the int8 code of NaN
    ref, got = [[t.clone() for t in ts] for ts in made], [[t.clone() for t in ts] for ts in made]
    got[STRIDED][0] = strided(got[STRIDED][0])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        wrote = steps([(ts, first) for ts, (_, first) in zip(got, SIZES)], lib)
    finally:
        torch.set_num_threads(threads)
    stop = len(SIZES) if bad is None else bad
    assert wrote == stop
    for i, (ts, (_, first)) in enumerate(zip(ref[:stop], SIZES)):
        assert one(ts, first, i)
    assert all(same(r, g) for r, g in zip(ref[:stop], got[:stop]))
    assert all(same(m, g) for m, g in zip(made[stop:], got[stop:]))
