"""Several models, optimizers and losses: the GAN pattern with per-loss scalers, overflow
isolation, unscaling only the optimizers given, and gradient accumulation with
``delay_unscale`` (numerically equal to one backward of the summed loss)."""
import copy

import pytest
import torch
from torch import nn

import ampkit
from ampkit._run.registry import current as current_run

LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
HALF_WEIGHTS = {"O2", "O3", "O5"}
# Relative tolerance of gradients against a float64 reference, per level (half arithmetic).
RTOL = {"O0": 1e-5, "O1": 2e-2, "O2": 2e-2, "O3": 2e-2, "O4": 6e-2, "O5": 6e-2}


def set_scales(*scales):
    """Start each dynamic scaler (of the latest initialize) at a scale that does not overflow
    float16 on these tiny nets."""
    for scaler, s in zip(current_run("test").scalers, scales):
        scaler.load_state_dict({"loss_scale": float(s), "unskipped": 0})


def scalers():
    return current_run("test").scalers


def Gen():
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6))


def Disc():
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def data(it):
    g = torch.Generator().manual_seed(10 + it)
    return torch.randn(6, 6, generator=g), torch.randn(6, 4, generator=g)


bce = nn.functional.binary_cross_entropy_with_logits


def f64(model):
    """A float64 copy of ``model`` holding exactly the values it computes with."""
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.data = p.data.double()
    ref.__class__ = type(model).__mro__[2] if hasattr(model, "_ampkit") else type(model)
    return ref


def gan(level, poison=None, iters=3, check_grads=False):
    """Apex's dcgan pattern: loss 0 (D, real), loss 1 (D, fake), loss 2 (G). ``poison=(it, k)``
    makes loss k's gradients inf at iteration ``it``. Returns per-iteration snapshots."""
    torch.manual_seed(0)
    G, D = Gen(), Disc()
    oG = torch.optim.Adam(G.parameters(), lr=1e-2)
    oD = torch.optim.SGD(D.parameters(), lr=0.1, momentum=0.9)
    [D, G], [oD, oG] = ampkit.initialize([D, G], [oD, oG], opt_level=level, num_losses=3, verbosity=0)
    if scalers()[0].dynamic:
        set_scales(64, 128, 256)
    snaps = []

    def maybe_poison(loss, it, k):
        return loss * float("inf") if poison == (it, k) else loss

    for it in range(iters):
        real, noise = data(it)
        oD.zero_grad()
        err_real = maybe_poison(bce(D(real), torch.ones(6, 1)), it, 0)
        with ampkit.scale_loss(err_real, oD, loss_id=0) as s:
            s.backward()
        fake = G(noise)
        err_fake = maybe_poison(bce(D(fake.detach()), torch.zeros(6, 1)), it, 1)
        with ampkit.scale_loss(err_fake, oD, loss_id=1) as s:
            s.backward()
        if check_grads:  # the masters hold the unscaled sum of both losses' gradients
            ref = f64(D)
            (bce(ref(real.double()), torch.ones(6, 1, dtype=torch.float64))
             + bce(ref(fake.detach().double()), torch.zeros(6, 1, dtype=torch.float64))).backward()
            for m, q in zip(ampkit.master_params(oD), ref.parameters()):
                torch.testing.assert_close(m.grad.double(), q.grad, rtol=RTOL[level], atol=RTOL[level] * 1e-1)
        oD.step()
        oG.zero_grad()
        err_g = maybe_poison(bce(D(fake), torch.ones(6, 1)), it, 2)
        with ampkit.scale_loss(err_g, oG, loss_id=2) as s:
            s.backward()
        if check_grads:
            refD, refG = f64(D), f64(G)
            bce(refD(refG(noise.double())), torch.ones(6, 1, dtype=torch.float64)).backward()
            for m, q in zip(ampkit.master_params(oG), refG.parameters()):
                torch.testing.assert_close(m.grad.double(), q.grad, rtol=RTOL[level], atol=RTOL[level] * 1e-1)
        oG.step()
        snaps.append({
            "D": [p.detach().clone() for p in D.parameters()] + [m.detach().clone() for m in ampkit.master_params(oD)],
            "G": [p.detach().clone() for p in G.parameters()] + [m.detach().clone() for m in ampkit.master_params(oG)],
            "oD": copy.deepcopy(oD.state_dict()["state"]),
            "oG": copy.deepcopy(oG.state_dict()["state"]),
            "scales": [s.loss_scale() for s in scalers()],
            "skipped": [s.skipped_steps for s in scalers()],
        })
    return snaps


def same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def test_lists_in_lists_out_one_scaler_per_loss():
    models, opts = [Gen(), Disc()], []
    opts = [torch.optim.SGD(models[0].parameters(), lr=0.1), torch.optim.Adam(models[1].parameters())]
    out_models, out_opts = ampkit.initialize(list(models), list(opts), opt_level="O2", num_losses=3, verbosity=0)
    assert isinstance(out_models, list) and isinstance(out_opts, list)
    assert all(a is b for a, b in zip(out_models, models)) and all(a is b for a, b in zip(out_opts, opts))
    assert len(scalers()) == 3 and len({id(s) for s in scalers()}) == 3
    assert list(ampkit.state_dict()) == ["loss_scaler0", "loss_scaler1", "loss_scaler2"]


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_gan_pattern_gradients_are_unscaled_sums(level):
    snaps = gan(level, check_grads=True)
    assert snaps[-1]["skipped"] == [0, 0, 0]
    assert not same(snaps[0]["D"], snaps[-1]["D"]) and not same(snaps[0]["G"], snaps[-1]["G"])


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_overflow_in_generator_loss_skips_only_the_generator(level):
    clean = gan(level)
    hit = gan(level, poison=(1, 2))
    assert same(hit[0], clean[0])
    # Iteration 1: D stepped exactly as without the overflow; G and its Adam state did not move.
    assert same(hit[1]["D"], clean[1]["D"]) and same(hit[1]["oD"], clean[1]["oD"])
    assert same(hit[1]["G"], hit[0]["G"]) and same(hit[1]["oG"], hit[0]["oG"])
    assert hit[1]["skipped"] == [0, 0, 1]
    dynamic = level != "O5"
    assert hit[1]["scales"] == [clean[1]["scales"][0], clean[1]["scales"][1], clean[1]["scales"][2] / (2 if dynamic else 1)]
    # Iteration 2: everyone trains again.
    assert not same(hit[2]["G"], hit[1]["G"]) and hit[2]["skipped"] == [0, 0, 1]


@pytest.mark.parametrize("k", [0, 1])
@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_overflow_in_a_discriminator_loss_skips_only_the_discriminator(level, k):
    clean = gan(level)
    hit = gan(level, poison=(1, k))
    assert same(hit[1]["D"], hit[0]["D"]) and same(hit[1]["oD"], hit[0]["oD"])  # D skipped, momentum kept
    assert not same(hit[1]["G"], hit[0]["G"])  # G stepped
    assert hit[1]["oG"][0]["step"].item() == 2
    expected = [0, 0, 0]
    expected[k] = 1
    assert hit[1]["skipped"] == expected
    scales = list(clean[1]["scales"])
    if level != "O5":
        scales[k] /= 2
    assert hit[1]["scales"] == scales


def _two_models(level):
    """G and D initialized with two losses (scales 8 and 32), a batch of noise, and float64
    copies of both whose gradients hold the reference for D(G(noise)) against ones."""
    torch.manual_seed(0)
    A, B = Gen(), Disc()
    oA, oB = torch.optim.SGD(A.parameters(), lr=0.1), torch.optim.SGD(B.parameters(), lr=0.1)
    [A, B], [oA, oB] = ampkit.initialize([A, B], [oA, oB], opt_level=level, num_losses=2, verbosity=0)
    set_scales(8, 32)
    _, noise = data(0)
    refA, refB = f64(A), f64(B)
    bce(refB(refA(noise.double())), torch.ones(6, 1, dtype=torch.float64)).backward()
    return A, B, oA, oB, noise, refA, refB


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_scale_loss_unscales_only_the_given_optimizer(level):
    A, B, oA, oB, noise, refA, refB = _two_models(level)

    loss = bce(B(A(noise)), torch.ones(6, 1))
    with ampkit.scale_loss(loss, oA, loss_id=1) as scaled:
        assert torch.equal(scaled, loss.float() * 32)  # loss 1's own scale
        scaled.backward()
    for m, q in zip(ampkit.master_params(oA), refA.parameters()):
        torch.testing.assert_close(m.grad.double(), q.grad, rtol=RTOL[level], atol=1e-4)
    # B's gradients were not unscaled: still 32x (in the model's grads; no master grads).
    for p, q in zip(B.parameters(), refB.parameters()):
        torch.testing.assert_close(p.grad.double() / 32, q.grad, rtol=RTOL[level], atol=1e-4)
    if level == "O2":
        assert all(m.grad is None for m in ampkit.master_params(oB))
    assert oB._ampkit.skip is None and oA._ampkit.skip is None


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_scale_loss_with_a_list_of_optimizers_unscales_them_all(level):
    A, B, oA, oB, noise, refA, refB = _two_models(level)
    loss = bce(B(A(noise)), torch.ones(6, 1))
    with ampkit.scale_loss(loss, [oA, oB], loss_id=0) as scaled:
        assert torch.equal(scaled, loss.float() * 8)
        scaled.backward()
    for opt, ref in ((oA, refA), (oB, refB)):
        for m, q in zip(ampkit.master_params(opt), ref.parameters()):
            torch.testing.assert_close(m.grad.double(), q.grad, rtol=RTOL[level], atol=1e-4)
    before = [m.detach().clone() for m in ampkit.master_params(oB)]
    oA.step()
    oB.step()
    assert not any(torch.equal(m, b) for m, b in zip(ampkit.master_params(oB), before))


def assert_near(a, b, tol):
    """Relative to the tensor's size: half-precision gradients of tiny elements are noisy."""
    a, b = a.double(), b.double()
    assert (a - b).norm() <= tol * b.norm(), ((a - b).norm() / b.norm()).item()


def Net():
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def chunk(i):
    g = torch.Generator().manual_seed(50 + i)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)


def accumulate(level, mode, base, windows=2, poison=None):
    """``mode``: "delay" (delay_unscale=True on all but the last backward), "plain" (every
    backward unscaled and added), or "sum" (one backward of the summed loss)."""
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0)
    if scalers()[0].dynamic:
        set_scales(128)
    grads = []
    for w in range(windows):
        opt.zero_grad()
        losses = [nn.functional.mse_loss(model(x), y) for x, y in map(chunk, range(3 * w, 3 * w + 3))]
        if poison == w:
            losses[0] = losses[0] * float("inf")
        if mode == "sum":
            with ampkit.scale_loss(sum(losses), opt) as s:
                s.backward()
        else:
            for i, loss in enumerate(losses):
                with ampkit.scale_loss(loss, opt, delay_unscale=(mode == "delay" and i < 2)) as s:
                    s.backward()
                if mode == "delay" and i == 0 and level in HALF_WEIGHTS and level != "O3":
                    # Inside the window the masters hold the scaled half grads, summed in fp32.
                    assert opt._ampkit.masters_scaled and opt._ampkit.scaled_by is not None
                    assert model[0].weight.grad is None and opt._ampkit.masters[model[0].weight].grad is not None
        grads.append([m.grad.clone() if m.grad is not None else None for m in ampkit.master_params(opt)])
        opt.step()
    return model, opt, grads


@pytest.mark.parametrize("level", LEVELS)
def test_delay_unscale_accumulation_equals_one_backward_of_the_summed_loss(level):
    torch.manual_seed(3)
    base = Net()
    results = {mode: accumulate(level, mode, base) for mode in ("sum", "delay", "plain")}
    tol = 1e-6 if level not in HALF_WEIGHTS else {"O2": 3e-3, "O3": 3e-3, "O5": 2e-2}[level]
    _, _, g_sum = results["sum"]
    for mode in ("delay", "plain"):
        model, opt, g = results[mode]
        for window_a, window_b in zip(g, g_sum):
            for a, b in zip(window_a, window_b):
                assert a.dtype == b.dtype
                assert_near(a, b, tol)
        for a, b in zip(ampkit.master_params(opt), ampkit.master_params(results["sum"][1])):
            assert_near(a, b, tol)
        assert opt._ampkit.run.scalers[0].skipped_steps == 0
    # The accumulated gradient is the sum of the three, not the last one: compare in float64.
    ref = copy.deepcopy(base)
    if level in HALF_WEIGHTS:  # the weights the run started from, rounded to its half dtype
        ref = ref.to(results["sum"][0][0].weight.dtype)
    ref = ref.double()
    sum(nn.functional.mse_loss(ref(x.double()), y.double()) for x, y in map(chunk, range(3))).backward()
    for a, q in zip(results["delay"][2][0], ref.parameters()):
        assert_near(a, q.grad, RTOL[level])


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_overflow_early_in_a_delayed_window_skips_the_step(level):
    torch.manual_seed(3)
    base = Net()
    model, opt, _ = accumulate(level, "delay", base, windows=1, poison=0)
    scaler = scalers()[0]
    assert scaler.skipped_steps == 1
    assert scaler.loss_scale() == (64.0 if scaler.dynamic else 1.0)  # backed off once, not per backward
    initial = copy.deepcopy(base)
    if level in HALF_WEIGHTS:
        initial = initial.to(model[0].weight.dtype)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), initial.parameters()))
    assert not opt.state or all(not s for s in opt.state.values())


def test_step_after_a_delayed_last_backward_unscales_it():
    """Forgetting to drop delay_unscale on the last backward still gives the right step."""
    torch.manual_seed(3)
    base = Net()
    _, good, _ = accumulate("O2", "delay", base, windows=1)
    model = copy.deepcopy(base)
    model, opt = ampkit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5), opt_level="O2", verbosity=0)
    set_scales(128)
    opt.zero_grad()
    for x, y in map(chunk, range(3)):
        with ampkit.scale_loss(nn.functional.mse_loss(model(x), y), opt, delay_unscale=True) as s:
            s.backward()
    opt.step()
    for a, b in zip(ampkit.master_params(opt), ampkit.master_params(good)):
        assert torch.equal(a, b)


def test_mixing_loss_ids_inside_a_delayed_window_is_refused():
    model = Net()
    model, opt = ampkit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", num_losses=2, verbosity=0)
    x, y = chunk(0)
    with ampkit.scale_loss(nn.functional.mse_loss(model(x), y), opt, loss_id=0, delay_unscale=True) as s:
        s.backward()
    with pytest.raises(RuntimeError, match="another loss's scaler"):
        with ampkit.scale_loss(nn.functional.mse_loss(model(x), y), opt, loss_id=1) as s:
            s.backward()


@pytest.mark.parametrize("poisoned", [False, True])
def test_a_delayed_window_shared_by_two_optimizers_counts_once(poisoned):
    """Stepping after a delay_unscale=True backward that fed two optimizers: one backward,
    one scaler update (one back-off on overflow, one clean step otherwise), both steps
    skipped or both taken."""
    torch.manual_seed(0)
    A, B = Gen(), Disc()
    oA, oB = torch.optim.SGD(A.parameters(), lr=0.1), torch.optim.SGD(B.parameters(), lr=0.1)
    [A, B], [oA, oB] = ampkit.initialize([A, B], [oA, oB], opt_level="O1", verbosity=0)
    set_scales(64)
    before = [p.detach().clone() for p in list(A.parameters()) + list(B.parameters())]
    loss = bce(B(A(data(0)[1])), torch.ones(6, 1))
    with ampkit.scale_loss(loss * float("inf") if poisoned else loss, [oA, oB], delay_unscale=True) as s:
        s.backward()
    oA.step()
    oB.step()
    scaler = scalers()[0]
    after = list(A.parameters()) + list(B.parameters())
    if poisoned:
        assert scaler.loss_scale() == 32.0 and scaler.skipped_steps == 1
        assert all(torch.equal(p, b) for p, b in zip(after, before))
    else:
        assert scaler.loss_scale() == 64.0 and scaler.unskipped == 1 and scaler.skipped_steps == 0
        assert not any(torch.equal(p, b) for p, b in zip(after, before))
