"""O7's fused AdamW: the C kernel equals the eager reference bit for bit (odd sizes,
non-contiguous and empty tensors, skipped steps, resumes, shards, threads), the reference
follows torch's AdamW, a machine without a compiler gets the same numbers, and the
compiled path that CUDA takes (forced here on CPU) gives them too."""
import copy
import ctypes
import logging
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit._kernels import compiled_update, native
from ampkit._kernels.fused_adamw import Hyper, step_
from ampkit._run.registry import current as current_run
from ampkit._update import fused_update

HYPERS = [Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, True, False, 3.0),  # AdamW
          Hyper(3e-2, 0.8, 0.99, 1e-6, 0.1, False, True, 1.0)]  # Adam with L2 decay, maximize


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def tensors(n: int, state_dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).bfloat16(), (torch.randn(n, generator=g) * 1e-2).bfloat16(),
            (torch.randn(n, generator=g) * 1e-3).to(state_dtype), (torch.rand(n, generator=g) * 1e-5).to(state_dtype)]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hyper", HYPERS)
@pytest.mark.parametrize("n", [0, 1, 7, 1001, 3 * native.MIN_PER_THREAD + 5])
def test_kernel_equals_the_eager_reference(lib, n, hyper, state_dtype):
    ref = tensors(n, state_dtype)
    got = [t.clone() for t in ref]
    step_(*ref, hyper, 5, 2, 1, 17, lib=None)
    step_(*got, hyper, 5, 2, 1, 17, lib=lib)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(ref, got))
    if n > 100:  # it stepped: weights and state moved
        fresh = tensors(n, state_dtype)
        assert not torch.equal(ref[0], fresh[0]) and not torch.equal(ref[2], fresh[2])


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_eager_reference_on_special_weights(lib, state_dtype):
    """Infinite, NaN and signed-zero weights and gradients: without L2 decay (AdamW, Adam
    without weight decay) the gradient takes no ``w * 0`` term (``inf * 0`` would be NaN)."""
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e-40, 3.0]).bfloat16()
    for hyper in (HYPERS[0], Hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, False, False, 2.0)):
        for grad in (special.flip(0), torch.full_like(special, -0.0)):
            ref = [special.clone(), grad.clone(), torch.zeros(7, dtype=state_dtype), torch.zeros(7, dtype=state_dtype)]
            got = [t.clone() for t in ref]
            step_(*ref, hyper, 5, 2, 1, 0, lib=None)
            step_(*got, hyper, 5, 2, 1, 0, lib=lib)
            for a, b in zip(ref, got):  # bit for bit, NaN payloads aside (C and torch make their own)
                nan = a.isnan()
                assert torch.equal(nan, b.isnan()) and torch.equal(bits(a)[~nan], bits(b)[~nan]), (hyper, grad)
            assert ref[2][:2].isfinite().all()  # an infinite weight's moment stays its gradient's


def test_kernel_on_non_contiguous_tensors_and_any_thread_count(lib):
    """The eager reference, the kernel on one thread and on two (two ranges), and the kernel
    on non-contiguous tensors (stepped through contiguous copies): the same bits."""
    n = 2 * native.MIN_PER_THREAD + 3
    base = tensors(n, torch.bfloat16)
    runs = {k: [t.clone() for t in base] for k in ("eager", "one", "two")}
    runs["strided"] = [torch.empty(2 * n, dtype=t.dtype)[::2].copy_(t) for t in base]  # stride 2
    assert not runs["strided"][0].is_contiguous() and torch.equal(runs["strided"][0], base[0])
    threads = torch.get_num_threads()
    try:
        step_(*runs["eager"], HYPERS[0], 1, 2, 3, 0, lib=None)
        for key, count in (("one", 1), ("two", 2), ("strided", 2)):
            torch.set_num_threads(count)
            step_(*runs[key], HYPERS[0], 1, 2, 3, 0, lib=lib)
    finally:
        torch.set_num_threads(threads)
    for key in ("one", "two", "strided"):
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(runs["eager"], runs[key])), key


@pytest.mark.parametrize("use_lib", [False, True])
def test_shards_step_as_the_whole_parameter(lib, use_lib):
    """A parameter stepped whole equals its pieces stepped from their offsets (FSDP2's shards
    of any world size, simulated in one process)."""
    whole = tensors(1000, torch.bfloat16)
    pieces = [t.clone() for t in whole]
    step_(*whole, HYPERS[0], 9, 4, 2, 0, lib=lib if use_lib else None)
    for a, b in [(0, 333), (333, 334), (334, 1000)]:
        step_(*(t[a:b] for t in pieces), HYPERS[0], 9, 4, 2, a, lib=lib if use_lib else None)
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(whole, pieces))


def test_the_reference_follows_torch_adamw():
    """One step from the same fp32 state: ``m`` and ``v`` within a few float32 roundings of
    their terms of torch's, and the weights rounded with the same bits land on the same bfloat16 but where
    the float32 results straddle a rounding threshold (at most 1 bf16 ulp apart, rarely)."""
    n = 100_000
    w, g, m, v = tensors(n, torch.float32)
    shadow = w.float().clone().requires_grad_()
    opt = torch.optim.AdamW([shadow], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    opt.state[shadow] = {"step": torch.tensor(2.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    shadow.grad = g.float()
    opt.step()
    m0, v0, g32 = m.clone(), v.clone(), g.float()
    step_(w, g, m, v, HYPERS[0], 0, 0, 0, 0)
    st = opt.state[shadow]
    # a few roundings of the terms each way (the sums may cancel, so relative to the terms)
    assert ((m - st["exp_avg"]).abs() <= 4 * 2**-24 * (0.9 * m0.abs() + 0.1 * g32.abs())).all()
    assert ((v - st["exp_avg_sq"]).abs() <= 4 * 2**-24 * (0.999 * v0 + 0.001 * g32.square())).all()
    theirs = torch.empty(n, dtype=torch.bfloat16)
    from ampkit._kernels.rounding import round_counter_
    round_counter_(theirs, shadow.detach().clone(), 0, 0, 0, 0, 0)
    differ = (bits(theirs) != bits(w))
    assert differ.float().mean() < 1e-3
    assert ((bits(theirs).int() - bits(w).int()).abs() <= 1).all()


class Net(nn.Module):
    """Odd sizes, an empty layer and a non-contiguous parameter."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.empty = nn.Linear(7, 13), nn.Linear(13, 3), nn.Linear(3, 0)
        self.extra = nn.Parameter(torch.randn(5, 3).t())

    def forward(self, x):
        out = self.b(torch.tanh(self.a(x)))
        return out.sum(1, keepdim=True) + (self.extra.sum() + self.empty(out).sum()) * 0.1


def make_model():
    torch.manual_seed(0)
    return Net()


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 7, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]


def train(model, opt, data, poison=()):
    for k, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = F.mse_loss(model(x).float(), y) * (float("inf") if k in poison else 1.0)
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()


ADAMS = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),  # what the fused paths take
         "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, maximize=True)}


def o7(state_dtype, adam="adamw"):
    model = make_model()
    opt = ADAMS[adam](model.parameters())
    return ampkit.initialize(model, opt, opt_level="O7", optimizer_state_dtype=state_dtype, verbosity=0)


def snapshot(model, opt):
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict()["state"])


def same(a, b) -> bool:
    (wa, sa), (wb, sb) = a, b
    return (all(torch.equal(bits(x), bits(y)) for x, y in zip(wa, wb)) and sa.keys() == sb.keys()
            and all(sa[i].keys() == sb[i].keys() and all(torch.equal(bits(sa[i][k]), bits(sb[i][k])) for k in sa[i])
                    for i in sa))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")  # a zero-size layer, on purpose
@pytest.mark.parametrize("adam", ["adamw", "adam"])
@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16])
def test_training_with_the_kernel_equals_the_eager_path(lib, monkeypatch, tmp_path, state_dtype, adam):
    """Four steps with a skipped one, saved, then two more after a load into a fresh run:
    kernel and eager path agree bit for bit at each point, and the resumed run equals the
    uninterrupted one."""
    data = batches(6)
    runs = {}
    for kind in ("kernel", "eager"):
        monkeypatch.setattr(native, "_state", {} if kind == "kernel" else {"lib": None})
        model, opt = o7(state_dtype, adam)
        assert all(fused_update.eligible(opt, opt.param_groups[0], p, p.detach(), state_dtype) for p in model.parameters())
        train(model, opt, data[:4], poison=(1,))
        assert current_run("t").scalers[0].skipped_steps == 1 and current_run("t").rounder.step == 3
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": ampkit.state_dict(optimizer=opt)},
                   tmp_path / f"{kind}.pt")
        middle = snapshot(model, opt)
        train(model, opt, data[4:])
        resumed, resumed_opt = o7(state_dtype, adam)
        ckpt = torch.load(tmp_path / f"{kind}.pt")
        resumed.load_state_dict(ckpt["model"])
        resumed_opt.load_state_dict(ckpt["optimizer"])
        ampkit.load_state_dict(ckpt["amp"], optimizer=resumed_opt)
        train(resumed, resumed_opt, data[4:])
        runs[kind] = middle, snapshot(model, opt), snapshot(resumed, resumed_opt)
        assert same(runs[kind][1], runs[kind][2])
        state = opt.state[model.a.weight]
        assert state["exp_avg"].dtype == (state_dtype or torch.float32) and state["step"].item() == 5.0
    assert all(same(a, b) for a, b in zip(runs["kernel"], runs["eager"]))
    assert not same(runs["kernel"][0], runs["kernel"][1])


def test_no_compiler_logs_one_line_and_gives_the_same_numbers(lib, monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="ampkit"):
        assert native.library() is None and native.library() is None
    lines = [r.getMessage() for r in caplog.records if "fused CPU kernels unavailable" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "eager path" in lines[0]
    ref = tensors(999, torch.bfloat16)
    got = [t.clone() for t in ref]
    step_(*ref, HYPERS[0], 1, 1, 1, 0, lib=lib)
    step_(*got, HYPERS[0], 1, 1, 1, 0, lib=native.library())
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(ref, got))


def test_the_build_is_cached(lib, monkeypatch, tmp_path):
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    path = native.build.build(native.compiler())
    stamp = (tmp_path / "kernels").stat().st_mtime_ns, os.stat(path).st_mtime_ns
    assert native.build.build(native.compiler()) == path
    assert ((tmp_path / "kernels").stat().st_mtime_ns, os.stat(path).st_mtime_ns) == stamp


def _libgomps() -> set:
    """The libgomp files mapped in this process (none where there is no /proc)."""
    if not os.path.exists("/proc/self/maps"):
        return set()
    with open("/proc/self/maps") as f:
        return {line.split()[-1] for line in f if "libgomp" in line.split()[-1]}


@pytest.mark.skipif(not _libgomps(), reason="torch runs on another OpenMP runtime than GNU's here")
def test_the_kernels_run_on_torchs_openmp_runtime(lib):
    """The kernels need the libgomp.so.1 torch loaded, not a second copy with its own threads."""
    before = _libgomps()
    library = native.build.build(native.compiler())
    ctypes.CDLL(library)
    assert _libgomps() == before and len(before) == 1
    with open(library, "rb") as f:
        assert b"libgomp.so.1" in f.read()  # linked to it (built with OpenMP here)


def test_a_compiler_without_openmp_builds_kernels_on_one_thread(monkeypatch, caplog, tmp_path):
    """An OpenMP flag the compiler rejects: one log line, kernels without it, the same numbers."""
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native.build, "OPENMP", "-fno-such-openmp-flag")
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="ampkit"):
        single = native.library()
    assert single is not None
    assert [r for r in caplog.records if "run on one thread" in r.getMessage()]
    n = 2 * native.MIN_PER_THREAD + 3
    ref = tensors(n, torch.bfloat16)
    got = [t.clone() for t in ref]
    step_(*ref, HYPERS[0], 1, 1, 1, 0, lib=None)
    step_(*got, HYPERS[0], 1, 1, 1, 0, lib=single)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(ref, got))


def test_ineligible_optimizers_and_settings_take_the_optimizer_step():
    p = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    g = torch.zeros(3, dtype=torch.bfloat16)
    for opt in (torch.optim.AdamW([p], amsgrad=True), torch.optim.SGD([p], lr=0.1), torch.optim.NAdam([p])):
        assert not fused_update.eligible(opt, opt.param_groups[0], p, g, None)
    opt = torch.optim.AdamW([p])
    assert fused_update.eligible(opt, opt.param_groups[0], p, g, None)
    assert not fused_update.eligible(opt, opt.param_groups[0], p, g.float(), None)  # a float32 gradient
    opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
    assert not fused_update.eligible(opt, opt.param_groups[0], p, g, torch.bfloat16)  # state not as this path keeps it


# -- O5's fp32 masters and remainder masters (_kernels/fused_masters.py) -------------------------------

def o5(master_weights, adam="adamw"):
    model = make_model()
    opt = ADAMS[adam](model.parameters())
    return ampkit.initialize(model, opt, opt_level="O5", master_weights=master_weights, verbosity=0)


def masters_of(model, opt):
    from ampkit._kernels.remainder import master
    if model._ampkit.remainders:
        return [master(p.detach(), model._ampkit.remainders[p]) for p in model.parameters()]
    return [m.detach().clone() for m in ampkit.master_params(opt)]


def full_snapshot(model, opt):
    return snapshot(model, opt), masters_of(model, opt)


def same_full(a, b) -> bool:
    return same(a[0], b[0]) and all(torch.equal(bits(x), bits(y)) for x, y in zip(a[1], b[1]))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")  # a zero-size layer, on purpose
@pytest.mark.parametrize("adam", ["adamw", "adam"])
def test_o5_and_remainder_masters_with_the_kernel_equal_the_eager_path_and_each_other(lib, monkeypatch, tmp_path, adam):
    """O5 and remainder masters (odd sizes, an empty layer, a non-contiguous parameter): four
    steps with a skipped one, saved, two more, and the same two after a load into a fresh run.
    Kernel and eager path agree bit for bit at each point (weights, state, masters), the resumed
    run equals the uninterrupted one, the remainder masters equal O5's, and the fused path ran."""
    data = batches(6)
    runs, calls = {}, []
    for name in ("step_masters", "step_remainders"):
        real = getattr(fused_update, name)
        monkeypatch.setattr(fused_update, name, lambda *a, _real=real, _name=name: (calls.append(_name), _real(*a))[1])
    for kind in ("kernel", "eager"):
        for mw in (True, "remainder"):
            monkeypatch.setattr(native, "_state", {} if kind == "kernel" else {"lib": None})
            model, opt = o5(mw, adam)
            train(model, opt, data[:4], poison=(1,))
            assert current_run("t").scalers[0].skipped_steps == 1
            ckpt = tmp_path / f"{kind}-{mw}.pt"
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": ampkit.state_dict(optimizer=opt)},
                       ckpt)
            middle = full_snapshot(model, opt)
            train(model, opt, data[4:])
            resumed, resumed_opt = o5(mw, adam)
            saved = torch.load(ckpt)
            resumed.load_state_dict(saved["model"])
            resumed_opt.load_state_dict(saved["optimizer"])
            ampkit.load_state_dict(saved["amp"], optimizer=resumed_opt)
            train(resumed, resumed_opt, data[4:])
            runs[kind, mw] = middle, full_snapshot(model, opt), full_snapshot(resumed, resumed_opt)
            assert same_full(runs[kind, mw][1], runs[kind, mw][2])
            state = next(iter(opt.state.values()))
            assert state["exp_avg"].dtype == torch.float32 and state["step"].item() == 5.0
    assert calls.count("step_masters") == calls.count("step_remainders") == 2 * (3 + 2 + 2)  # every unskipped step
    for key in runs:
        assert all(same_full(a, b) for a, b in zip(runs[key], runs["kernel", True])), key
    assert not same_full(runs["kernel", True][0], runs["kernel", True][1])


@pytest.mark.parametrize("grads", ["fresh", "reused"])
@pytest.mark.parametrize("variant", ["default", "foreach"])
@pytest.mark.parametrize("adam", ["adamw", "adam"])
def test_o5_fused_is_the_hand_written_master_loop_with_its_arithmetic(lib, monkeypatch, adam, variant, grads):
    """O5 with the fused update is bit for bit the hand-written master-weight loop of
    tests/optim/test_master_weights.py whose masters and fp32 BatchNorm parameters step in
    ``step_master_eager``: model, masters and state."""
    from ampkit._kernels.fused_masters import step_master_eager
    from ampkit._optim import optimizer_state
    from tests.optim.test_master_weights import HALF, Net as BNNet, Reference, amp_step, batch, init
    monkeypatch.setattr(optimizer_state, "REUSED_GRADS_BYTES", 0 if grads == "reused" else 2**62)
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[adam]
    kw = {"lr": 1e-2, "weight_decay": 0.1, **({"foreach": True} if variant == "foreach" else {})}
    base = BNNet()
    ref = Reference(base, HALF["O5"], cls, kw, 1.0)
    torch_step, stepped = ref.opt.step, [m for _, m in ref.pairs]
    assert any(m is p for p, m in ref.pairs) and any(m is not p for p, m in ref.pairs)  # fp32 norms and masters

    def fused_reference_step():
        held = [(m, m.grad) for m in stepped]
        for m in stepped:
            state = ref.opt.state[m]
            if not state:
                state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(m), exp_avg_sq=torch.zeros_like(m))
            state["step"] += 1
            g = ref.opt.param_groups[0]
            hyper = Hyper(g["lr"], *g["betas"], g["eps"], g["weight_decay"], cls is torch.optim.AdamW, False,
                          state["step"].item())
            with torch.no_grad():
                step_master_eager(m, m.grad, state["exp_avg"], state["exp_avg_sq"], hyper)
            m.grad = None
        torch_step()
        for m, g in held:
            m.grad = g

    ref.opt.step = fused_reference_step
    model = copy.deepcopy(base)
    model, opt = init(model, cls(model.parameters(), **kw), "O5")
    masters = list(ampkit.master_params(opt))
    for step in range(4):
        x, y = batch(step)
        assert torch.equal(amp_step(model, opt, x, y), ref.step(x, y))
    for (n, p), (q, m), master in zip(model.named_parameters(), ref.pairs, masters):
        assert torch.equal(bits(p), bits(q)) and torch.equal(bits(master), bits(m)), n
        assert opt.state[master].keys() == ref.opt.state[m].keys()
        assert all(torch.equal(bits(opt.state[master][k]), bits(ref.opt.state[m][k])) for k in opt.state[master]), n
    assert list(opt.state) == masters  # the state in the parameters' order, as torch's own step makes it


def test_masters_of_ineligible_optimizers_and_settings_take_the_optimizer_step(monkeypatch):
    from ampkit._update.fused_update import master_eligible, masters_to_step
    p = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    m = torch.zeros(3, requires_grad=True)
    m.grad = torch.zeros(3)
    for opt in (torch.optim.AdamW([m], amsgrad=True), torch.optim.AdamW([m], fused=True), torch.optim.SGD([m], lr=0.1),
                torch.optim.NAdam([m])):
        assert not master_eligible(opt, opt.param_groups[0], m, p) and masters_to_step(opt, {m: p}) == []
    opt = torch.optim.AdamW([m])
    assert master_eligible(opt, opt.param_groups[0], m, p) and masters_to_step(opt, {m: p}) == [(opt.param_groups[0], m, p)]
    assert not master_eligible(opt, opt.param_groups[0], m, p.half())  # O2's float16 model: torch's step
    monkeypatch.setenv("AMPKIT_FUSED", "0")
    assert masters_to_step(opt, {m: p}) == []
    monkeypatch.delenv("AMPKIT_FUSED")
    m.grad = torch.zeros(3).to_sparse()
    assert not master_eligible(opt, opt.param_groups[0], m, p)
    m.grad = torch.zeros(3)
    opt.state[m] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3, dtype=torch.float64), "exp_avg_sq": torch.zeros(3)}
    assert not master_eligible(opt, opt.param_groups[0], m, p)  # state not as this path keeps it
@pytest.mark.slow  # inductor compiles a graph per state dtype (about 10 s each on 2 cores)
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16])
def test_training_through_the_compiled_update_equals_the_kernel(lib, monkeypatch, tmp_path, state_dtype):
    """O7 with the compiled path forced on CPU (the path CUDA parameters take): every non-empty
    parameter steps in the compiled kernel, and weights and state equal the C kernel's bit
    for bit after steps with a skipped one."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    calls = []
    step_compiled = compiled_update.step_compiled
    monkeypatch.setattr(compiled_update, "step_compiled", lambda w, *a: calls.append(w.numel()) or step_compiled(w, *a))
    runs = {}
    for kind in ("kernel", "compiled"):
        monkeypatch.setattr(compiled_update, "ON_CPU", kind == "compiled")
        model, opt = o7(state_dtype)
        train(model, opt, batches(4), poison=(1,))
        runs[kind] = snapshot(model, opt)
        nonempty = sorted(p.numel() for p in model.parameters() if p.numel())
        assert sorted(calls) == (sorted(nonempty * 3) if kind == "compiled" else [])
    assert same(runs["kernel"], runs["compiled"])
    assert not same(runs["compiled"], snapshot(*o7(state_dtype)))


def test_cuda_parameters_are_eligible_where_the_compiled_update_runs(monkeypatch):
    """A (fake) CUDA parameter steps in the fused path exactly when the compiled update is
    available there (Triton installed), else in torch's AdamW."""
    import torch.utils._triton as triton_utils
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        p = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16, device="cuda"))
        g = torch.zeros(3, dtype=torch.bfloat16, device="cuda")
    opt = torch.optim.AdamW([p])
    for has_triton in (False, True):
        monkeypatch.setattr(triton_utils, "has_triton", lambda: has_triton)
        assert fused_update.eligible(opt, opt.param_groups[0], p, g, None) is has_triton
    monkeypatch.setenv("AMPKIT_COMPILED_UPDATE", "0")
    assert not fused_update.eligible(opt, opt.param_groups[0], p, g, None)
