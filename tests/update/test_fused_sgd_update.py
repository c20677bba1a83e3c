"""Fused SGD at O5 (fp32 masters) and O7 (bf16 weights, fp32 or bf16 buffers): kernel and eager
reference agree bit for bit through training, skipped steps and a resume; both are torch's SGD
(O5's masters, O7's chunked update with ``AMPKIT_FUSED=0``) where torch's operations round once
each, and within a float32 rounding or two where its AVX loops fuse a multiply and an add; the
state is torch's, so checkpoints move between the paths."""
import pytest
import torch
from torch import nn

import ampkit
from ampkit._kernels import compiled_sgd, compiled_update, native
from ampkit._run.registry import current as current_run
from ampkit._update import fused_sgd_update
from tests.kernels.test_fused_sgd import contracts
from tests.update.test_fused_update import batches, bits, make_model, same, snapshot, train

pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")  # a zero-size layer

SGDS = {  # powers of two: torch's add(alpha=) is exact before its one rounding, on any kernel
    "exact": dict(lr=0.125, momentum=0.5, weight_decay=2.0 ** -4, dampening=0.5, maximize=True),
    "nesterov-exact": dict(lr=2.0 ** -5, momentum=0.5, nesterov=True),
    "momentum": dict(lr=0.05, momentum=0.9),
    "all": dict(lr=0.03, momentum=0.9, dampening=0.1, weight_decay=0.01),
    "plain": dict(lr=0.05),
}
EXACT = ("exact", "nesterov-exact")


def make(level, sgd, state_dtype=None, **kw):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), **SGDS[sgd])
    return ampkit.initialize(model, opt, opt_level=level, verbosity=0,
                             **({"optimizer_state_dtype": state_dtype} if level == "O7" else {}), **kw)


def masters(opt):
    return [m.detach().clone() for m in ampkit.master_params(opt)]


def run(level, sgd, state_dtype, path, monkeypatch, data, poison=()):
    """A trained (model, optimizer) on ``path``: the kernel, the eager reference, or torch's SGD."""
    monkeypatch.setattr(native, "_state", {"lib": None} if path == "eager" else {})
    monkeypatch.setenv("AMPKIT_FUSED", "0" if path == "torch" else "1")
    model, opt = make(level, sgd, state_dtype)
    train(model, opt, data, poison)
    return model, opt


def close(a, b, level) -> None:
    """Within a float32 rounding or two of the steps (O7: of a bf16 weight where they straddle a rounding)."""
    tol = dict(rtol=2e-6, atol=1e-7) if level == "O5" else dict(rtol=8e-3, atol=1e-5)
    for x, y in zip(a[0], b[0]):
        torch.testing.assert_close(x.float(), y.float(), **tol)


@pytest.mark.parametrize("level, state_dtype", [("O5", None), ("O7", None), ("O7", torch.bfloat16)])
@pytest.mark.parametrize("sgd", list(SGDS))
def test_kernel_eager_and_torchs_sgd(lib, monkeypatch, level, state_dtype, sgd):
    """Five steps, the second skipped (an infinite loss): kernel == eager reference bit for bit
    (weights, state, masters); == torch's SGD where its operations round once each, else close."""
    data, calls = batches(5), []
    real = fused_sgd_update.step_masters if level == "O5" else fused_sgd_update.step
    monkeypatch.setattr(fused_sgd_update, real.__name__, lambda *a: (calls.append(1), real(*a))[1])
    runs = {}
    for path in ("kernel", "eager", "torch"):
        model, opt = run(level, sgd, state_dtype, path, monkeypatch, data, poison=(1,))
        assert current_run("t").scalers[0].skipped_steps == 1
        runs[path] = snapshot(model, opt), masters(opt)
        momentum = SGDS[sgd].get("momentum", 0)
        if level == "O7":
            assert current_run("t").rounder.step == 4
        for p in opt.param_groups[0]["params"]:
            assert set(opt.state.get(p, {})) == ({"momentum_buffer"} if momentum else set())
            if momentum:
                buf = opt.state[p]["momentum_buffer"]
                assert buf.dtype == (state_dtype or torch.float32) and buf.shape == p.shape
    assert len(calls) == 2 * 4  # the kernel's and the eager run's unskipped steps
    assert same(runs["kernel"][0], runs["eager"][0]) and all(torch.equal(a, b) for a, b in zip(runs["kernel"][1], runs["eager"][1]))
    if sgd in EXACT or not contracts():
        assert same(runs["kernel"][0], runs["torch"][0])
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(runs["kernel"][1], runs["torch"][1]))
    else:
        close(runs["kernel"][0], runs["torch"][0], level)
    assert not same(runs["kernel"][0], snapshot(*make(level, sgd, state_dtype)))


@pytest.mark.parametrize("level, state_dtype", [("O5", None), ("O7", None), ("O7", torch.bfloat16)])
def test_a_skipped_step_changes_nothing(lib, monkeypatch, level, state_dtype):
    data = batches(3)
    model, opt = run(level, "all", state_dtype, "kernel", monkeypatch, data[:2])
    rounder = current_run("t").rounder
    before, rounded = (snapshot(model, opt), masters(opt)), rounder and rounder.step
    train(model, opt, data[2:], poison=(0,))
    assert current_run("t").scalers[0].skipped_steps == 1 and (rounder and rounder.step) == rounded
    assert same(before[0], snapshot(model, opt)) and all(torch.equal(a, b) for a, b in zip(before[1], masters(opt)))


@pytest.mark.parametrize("level, state_dtype", [("O5", None), ("O7", None), ("O7", torch.bfloat16)])
def test_a_resume_equals_the_uninterrupted_run_and_checkpoints_move_to_torchs_sgd(lib, monkeypatch, tmp_path, level,
                                                                                   state_dtype):
    """Saved after three steps, two more: in a fresh run loaded from the checkpoint (the same
    bits), and on the eager chunked path (``AMPKIT_FUSED=0``) loaded from it (exact settings:
    the same bits too). The saved state is torch's: a plain SGD loads it."""
    data = batches(5)
    model, opt = run(level, "exact", state_dtype, "kernel", monkeypatch, data[:3])
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": ampkit.state_dict(optimizer=opt)}
    torch.save(ckpt, tmp_path / "c.pt")
    train(model, opt, data[3:])
    for path in ("kernel", "torch"):
        monkeypatch.setenv("AMPKIT_FUSED", "0" if path == "torch" else "1")
        resumed, resumed_opt = make(level, "exact", state_dtype)
        saved = torch.load(tmp_path / "c.pt")
        resumed.load_state_dict(saved["model"])
        resumed_opt.load_state_dict(saved["optimizer"])
        ampkit.load_state_dict(saved["amp"], optimizer=resumed_opt)
        train(resumed, resumed_opt, data[3:])
        assert same(snapshot(model, opt), snapshot(resumed, resumed_opt)), path
        assert all(torch.equal(a, b) for a, b in zip(masters(opt), masters(resumed_opt))), path
    plain = torch.optim.SGD([torch.zeros_like(p, dtype=torch.float32, requires_grad=True) for p in make_model().parameters()],
                            **SGDS["exact"])
    plain.load_state_dict(ckpt["optimizer"])
    assert set(s for st in plain.state.values() for s in st) == {"momentum_buffer"}


def test_a_scheduled_lr_is_read_every_step(lib, monkeypatch):
    data = batches(4)
    runs = []
    for path in ("kernel", "torch"):
        monkeypatch.setenv("AMPKIT_FUSED", "0" if path == "torch" else "1")
        model, opt = make("O7", "exact")
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        for batch in data:
            train(model, opt, [batch])
            sched.step()
        runs.append(snapshot(model, opt))
    assert same(*runs) and opt.param_groups[0]["lr"] == 0.125 / 16


def test_ineligible_optimizers_and_settings_take_the_optimizer_step(monkeypatch):
    p = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    g = torch.zeros(3, dtype=torch.bfloat16)
    m = torch.zeros(3, requires_grad=True)
    m.grad = torch.zeros(3)

    class MySGD(torch.optim.SGD):
        pass
    for opt in (MySGD([p], lr=0.1), torch.optim.SGD([p], lr=0.1, differentiable=True), torch.optim.AdamW([p])):
        assert not fused_sgd_update.eligible(opt, opt.param_groups[0], p, g, None)
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    assert fused_sgd_update.eligible(opt, opt.param_groups[0], p, g, None)
    assert not fused_sgd_update.eligible(opt, opt.param_groups[0], p, g.float(), None)  # a float32 gradient
    opt.state[p] = {"momentum_buffer": torch.zeros(3)}
    assert not fused_sgd_update.eligible(opt, opt.param_groups[0], p, g, torch.bfloat16)  # not as this path keeps it
    opt = torch.optim.SGD([m], lr=0.1, momentum=0.9)
    assert fused_sgd_update.masters_to_step(opt, {m: p}) == [(opt.param_groups[0], m, p)]
    monkeypatch.setenv("AMPKIT_FUSED", "0")
    assert fused_sgd_update.masters_to_step(opt, {m: p}) == []
    for opt in (MySGD([m], lr=0.1), torch.optim.SGD([m], lr=0.1, fused=True)):
        assert not fused_sgd_update.master_eligible(opt, opt.param_groups[0], m, p)


@pytest.mark.slow  # inductor compiles a graph per buffer kind (a few seconds each on 2 cores)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16])
def test_o7_through_the_compiled_sgd_equals_the_kernel(lib, monkeypatch, tmp_path, state_dtype):
    """O7 with the compiled path forced on CPU (the path CUDA parameters take): every non-empty
    parameter steps in the compiled kernel at each unskipped step, and weights and buffers equal
    the C kernel's bit for bit after five steps with a skipped one."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    calls, data = [], batches(5)
    real = compiled_sgd.step_compiled
    monkeypatch.setattr(compiled_sgd, "step_compiled", lambda w, *a: calls.append(w.numel()) or real(w, *a))
    for sgd in ("all", "nesterov-exact", "exact", "plain"):
        runs = {}
        for kind in ("kernel", "compiled"):
            calls.clear()
            monkeypatch.setattr(compiled_update, "ON_CPU", kind == "compiled")
            model, opt = run("O7", sgd, state_dtype, "kernel", monkeypatch, data, poison=(1,))
            runs[kind] = snapshot(model, opt)
            nonempty = sorted(p.numel() for p in model.parameters() if p.numel())
            assert sorted(calls) == (sorted(nonempty * 4) if kind == "compiled" else []), (sgd, kind)
        assert same(runs["kernel"], runs["compiled"]), sgd
        assert not same(runs["compiled"], snapshot(*make("O7", sgd, state_dtype)))


def test_cuda_parameters_are_eligible_where_the_compiled_sgd_runs(monkeypatch):
    """A (fake) CUDA parameter steps in O7's fused SGD exactly when the compiled kernel is
    available there (Triton installed), else in torch's SGD; remainder masters' fused SGD (C)
    stays on CPU."""
    import torch.utils._triton as triton_utils
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        p = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16, device="cuda"))
        g = torch.zeros(3, dtype=torch.bfloat16, device="cuda")
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    for has_triton in (False, True):
        monkeypatch.setattr(triton_utils, "has_triton", lambda: has_triton)
        assert fused_sgd_update.eligible(opt, opt.param_groups[0], p, g, None) is has_triton
        assert not fused_sgd_update.remainder_eligible(opt, opt.param_groups[0], p, g)
    monkeypatch.setenv("AMPKIT_COMPILED_UPDATE", "0")
    assert not fused_sgd_update.eligible(opt, opt.param_groups[0], p, g, None)
    q = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    opt = torch.optim.SGD([q], lr=0.1, momentum=0.9)
    assert fused_sgd_update.remainder_eligible(opt, opt.param_groups[0], q, torch.zeros(3, dtype=torch.bfloat16))
