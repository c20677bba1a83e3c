"""SGD in one pass (O5's masters, O7's bf16 weights): the C kernels equal the eager references bit
for bit (every option, odd, empty and strided tensors, first and later steps, 1 or 2 threads,
float32 and bf16 buffers); the references are torch's SGD where its operations round once each."""
import itertools

import pytest
import torch

from ampkit._kernels import native
from ampkit._kernels.fused_sgd import Hyper, step_, step_master_

SIZES = [0, 1, 7, 1023, 4099, 2 * native.MIN_PER_THREAD + 3]
HYPERS = [Hyper(0.05, momentum, dampening, wd, nesterov, maximize)
          for momentum, dampening, wd, nesterov, maximize in itertools.product((0.0, 0.9), (0.0, 0.1), (0.0, 0.01),
                                                                               (False, True), (False, True))
          if not (nesterov and (momentum == 0 or dampening != 0))]  # torch's SGD refuses those


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def same(a, b) -> bool:
    return all((x is None and y is None) or (x.dtype == y.dtype and torch.equal(bits(x), bits(y))) for x, y in zip(a, b))


def tensors(n: int, hyper: Hyper, state, seed: int = 0):
    """weight, gradient, buffer (None when momentum is 0): float32 (O5, ``state`` None) or bf16
    weights with a ``state`` buffer."""
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if state is None else torch.bfloat16
    buf = None if hyper.momentum == 0 else (torch.randn(n, generator=g) * 1e-2).to(state or torch.float32)
    return [torch.randn(n, generator=g).to(dtype), (torch.randn(n, generator=g) * 1e-2).to(dtype), buf]


def clone(ts):
    return [None if t is None else t.clone() for t in ts]


def run(kind, ts, hyper, new, lib, step=3):
    """One step of ``ts`` (weight, grad, buf[, bf16 model weight]) in place."""
    if kind == "master":
        step_master_(ts[0], ts[1], ts[2], hyper, new, ts[3] if len(ts) > 3 else None, lib=lib)
    else:
        step_(ts[0], ts[1], ts[2], hyper, new, 1234, step, 5, 17, lib=lib)


KINDS = [("master", None), ("bf16", torch.float32), ("bf16", torch.bfloat16)]


@pytest.mark.parametrize("kind, state", KINDS)
@pytest.mark.parametrize("hyper", HYPERS)
@pytest.mark.parametrize("n", SIZES)
def test_kernel_equals_the_eager_reference(lib, n, hyper, kind, state):
    """The first step (the buffer made from the gradient) and two later ones."""
    ref = tensors(n, hyper, state) + ([torch.empty(n, dtype=torch.bfloat16)] if kind == "master" else [])
    got = clone(ref)
    for step, new in enumerate((True, False, False)):
        run(kind, ref, hyper, new, None, step)
        run(kind, got, hyper, new, lib, step)
        assert same(ref, got), step
    if kind == "master":
        assert torch.equal(ref[3], ref[0].bfloat16())  # the model weight: the master rounded to nearest even
    if n > 100:
        start = tensors(n, hyper, state)
        assert not torch.equal(ref[0], start[0]) and (ref[2] is None or not torch.equal(ref[2], start[2]))


@pytest.mark.parametrize("kind, state", KINDS)
def test_strided_tensors_and_any_thread_count(lib, kind, state):
    n, hyper = 2 * native.MIN_PER_THREAD + 3, Hyper(0.05, 0.9, 0.0, 0.01, True, False)
    base = tensors(n, hyper, state) + ([torch.empty(n, dtype=torch.bfloat16)] if kind == "master" else [])
    runs = {k: clone(base) for k in ("eager", "one", "two")}
    runs["strided"] = [torch.empty(n, 2, dtype=t.dtype)[:, 1].copy_(t) for t in base]
    threads = torch.get_num_threads()
    try:
        run(kind, runs["eager"], hyper, False, None)
        for key, count in (("one", 1), ("two", 2), ("strided", 2)):
            torch.set_num_threads(count)
            run(kind, runs[key], hyper, False, lib)
    finally:
        torch.set_num_threads(threads)
    for key in ("one", "two", "strided"):
        assert same(runs["eager"], runs[key]), key
    assert not runs["strided"][0].is_contiguous()


def torch_sgd(p, grad, buf, hyper: Hyper):
    """torch.optim.SGD's step of float32 ``p`` (a copy), its buffer after it."""
    p = p.clone().requires_grad_()
    opt = torch.optim.SGD([p], lr=hyper.lr, momentum=hyper.momentum, dampening=hyper.dampening,
                          weight_decay=hyper.weight_decay, nesterov=hyper.nesterov, maximize=hyper.maximize)
    if buf is not None:
        opt.state[p]["momentum_buffer"] = buf.clone()
    p.grad = grad.clone()
    opt.step()
    return p.detach(), opt.state[p].get("momentum_buffer")


def contracts() -> bool:
    """Whether torch's ``add(alpha=)`` here is one fused multiply-add (its AVX2 / AVX512 loops)
    rather than a multiply and an add (its portable kernels)."""
    a, b = torch.randn(4096, generator=torch.Generator().manual_seed(0)).chunk(2)
    return not torch.equal(a.add(b, alpha=0.1), a.add(b.mul(0.1)))


EXACT = [Hyper(0.5, 0.9, 0.0, 0.0, False, False), Hyper(0.25, 0.5, 0.5, 0.125, False, True),
         Hyper(2.0 ** -6, 0.5, 0.0, 0.0, True, False), Hyper(0.125, 0.0, 0.0, 0.0, False, False)]


@pytest.mark.parametrize("hyper", EXACT + HYPERS)
def test_the_reference_is_torchs_sgd_where_its_operations_round_once(hyper):
    """With powers of two for lr, weight decay, 1 - dampening (and momentum with nesterov) every
    ``add(alpha=)`` of torch's SGD is exact before its one rounding, so it is our arithmetic bit
    for bit; other values too where torch's kernels do not fuse the multiply and the add
    (``ATEN_CPU_CAPABILITY=default``). Where they do, within an ulp or two."""
    n = 4099
    for new in (True, False):
        x, grad, buf = tensors(n, hyper, None, seed=1)
        want_x, want_buf = torch_sgd(x, grad, None if new else buf, hyper)
        buf = None if buf is None else torch.empty_like(buf) if new else buf
        step_master_(x, grad, buf, hyper, new)
        if hyper in EXACT or not contracts():
            assert same([x, buf], [want_x, want_buf])
        else:
            torch.testing.assert_close(x, want_x, rtol=2.5e-7, atol=1e-9)


@pytest.mark.parametrize("kind, state", KINDS)
def test_the_declared_ops_give_the_kernels_bits(kind, state):
    from ampkit._kernels import ops
    hyper = Hyper(0.05, 0.9, 0.1, 0.01, False, True)
    ref = tensors(1023, hyper, state) + ([torch.empty(1023, dtype=torch.bfloat16)] if kind == "master" else [])
    got = clone(ref)
    for step, new in enumerate((True, False)):
        run(kind, ref, hyper, new, native.library(), step)
        if kind == "master":
            ops.sgd_master_steps_([(*got[:3], new, got[3])], hyper)
        else:
            ops.sgd_steps_([(*got, new, 5, 17)], hyper, 1234, step)
        assert same(ref, got)
    none = [t.clone() for t in ref[:2]]  # momentum 0: no buffer
    momentum0 = Hyper(0.05, 0.0, 0.0, 0.0, False, False)
    if kind == "master":
        ops.sgd_master_steps_([(*none, None, False, None)], momentum0)
    else:
        ops.sgd_steps_([(*none, None, False, 5, 17)], momentum0, 1234, 0)
    assert not torch.equal(none[0], ref[0])


@pytest.mark.parametrize("kind, state", KINDS)
def test_the_declared_ops_compile_into_one_graph_with_the_eager_bits(lib, kind, state):
    """``fullgraph=True`` (``aot_eager``): the ops trace (their fakes); three compiled steps, the
    first making the buffer, equal three eager ones."""
    from ampkit._kernels import ops
    hyper = Hyper(0.05, 0.9, 0.0, 0.01, True, False)

    def step(w, grad, buf, extra, rstep):
        if kind == "master":
            ops.sgd_master_steps_([(w, grad, buf, rstep == 0, extra)], hyper)
        else:
            ops.sgd_steps_([(w, grad, buf, rstep == 0, 5, 17)], hyper, 1234, rstep)

    base = tensors(1023, hyper, state) + [torch.empty(1023, dtype=torch.bfloat16)]
    runs = [base, clone(base)]
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for rstep in range(3):
        step(*runs[0], rstep)
        compiled(*runs[1], rstep)
    assert same(*runs) and not torch.equal(runs[1][0], tensors(1023, hyper, state)[0])


@pytest.mark.parametrize("kind, state", KINDS)
def test_kernel_equals_the_eager_reference_on_special_values(lib, kind, state):
    """Infinite, NaN, signed-zero and subnormal weights, gradients and buffers: the same values
    (NaN payloads aside); without weight decay no ``p * 0`` term (``inf * 0`` would be NaN)."""
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e-40, 3.0])
    dtype = torch.float32 if state is None else torch.bfloat16
    for hyper in (Hyper(0.05, 0.9, 0.1, 0.01, False, True), Hyper(0.05, 0.9, 0.0, 0.0, True, False)):
        for grad in (special.flip(0), torch.full_like(special, -0.0)):
            ref = [special.to(dtype), grad.to(dtype), special.roll(3).to(state or torch.float32)]
            got = clone(ref)
            run(kind, ref, hyper, False, None)
            run(kind, got, hyper, False, lib)
            for a, b in zip(ref, got):
                nan = a.isnan()
                assert torch.equal(nan, b.isnan()) and torch.equal(bits(a)[~nan], bits(b)[~nan]), (hyper, grad)


@pytest.mark.parametrize("kind, state", KINDS)
def test_a_groups_tensors_in_one_op_step_as_each_alone(lib, kind, state):
    """The op over a group (odd, empty and large tensors, one strided; first and later steps): one
    kernel call for the contiguous ones, each tensor with `step_`'s / `step_master_`'s bits."""
    from ampkit._kernels import ops

    hyper = Hyper(0.05, 0.9, 0.1, 0.01, False, True)
    sizes = [1001, 0, 7, 2 * native.MIN_PER_THREAD + 3]
    weights = [torch.empty(n, dtype=torch.bfloat16) for n in sizes] if kind == "master" else [None] * len(sizes)
    ref = [tensors(n, hyper, state, seed) + [w] for seed, (n, w) in enumerate(zip(sizes, weights))]
    got = [clone(ts) for ts in ref]
    got[2] = [None if t is None else torch.empty(2 * t.numel(), dtype=t.dtype)[::2].copy_(t) for t in got[2]]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for step, new in enumerate((True, False)):
            if kind == "master":
                ops.sgd_master_steps_([(x, g, b, new, w) for x, g, b, w in got], hyper)
            else:
                ops.sgd_steps_([(w, g, b, new, i, 13 * i) for i, (w, g, b, _) in enumerate(got)], hyper, 1234, step)
            for i, ts in enumerate(ref):
                if kind == "master":
                    step_master_(*ts[:3], hyper, new, ts[3])
                else:
                    step_(*ts[:3], hyper, new, 1234, step, i, 13 * i)
    finally:
        torch.set_num_threads(threads)
    assert all(same(r, g) for r, g in zip(ref, got))
    assert not torch.equal(ref[0][0], tensors(sizes[0], hyper, state, 0)[0])
