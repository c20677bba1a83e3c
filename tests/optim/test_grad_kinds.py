"""Gradients and optimizers that are not plain dense real tensors, against the float32 loop
and torch.amp.GradScaler: sparse embedding gradients (SGD, SparseAdam), complex parameters,
closure-only optimizers (refused), and ``zero_grad(set_to_none=False)``."""
import pytest
import torch
from torch import nn

import ampkit
import ampkit._model.casting
from ampkit._run.registry import current as current_run

LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
HALF = {"O0": torch.float32, "O1": torch.float16, "O2": torch.float16, "O3": torch.float16,
        "O4": torch.bfloat16, "O5": torch.bfloat16}
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float16: dict(rtol=5e-3, atol=5e-3),
       torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(12, 4, sparse=True)
        self.fc = nn.Linear(4, 3)

    def forward(self, idx):  # the embedding is used twice: autograd adds its sparse gradients
        return self.fc(self.emb(idx).mean(1) + 0.5 * self.emb(idx[:, :2]).mean(1))


def _batches(n=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 12, (8, 5), generator=g), 0.5 * torch.randn(8, 3, generator=g)) for _ in range(n)]


def _optimizers(model, kind):
    if kind == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=0.2)]
    return [torch.optim.SparseAdam([model.emb.weight], lr=0.05, eps=1e-3), torch.optim.SGD(model.fc.parameters(), lr=0.2)]


def _train_bag(level, kind, overflow_at=None):
    torch.manual_seed(0)
    model = Bag()
    opts = _optimizers(model, kind)
    if level is not None:
        model, opts = ampkit.initialize(model, opts, opt_level=level, verbosity=0)
    seen = []
    for i, (idx, y) in enumerate(_batches()):
        for o in opts:
            o.zero_grad()
        loss = nn.functional.mse_loss(model(idx), y)
        if i == overflow_at:
            loss = loss * float("inf")
        if level is None:
            loss.backward()
        else:
            with ampkit.scale_loss(loss, opts) as s:
                s.backward()
        for o in opts:
            o.step()
        seen.append({k: v.clone() for k, v in model.state_dict().items()})
    return model, seen


def _sparse_trainable(level):
    """torch cannot add sparse float16 gradients on CPU: O2/O3 (a float16 model) refuse there."""
    return level not in ("O2", "O3") or ampkit._model.casting._sparse_add_works(torch.float16, torch.device("cpu"))


SPARSE_LEVELS = [lvl for lvl in LEVELS if _sparse_trainable(lvl)]  # the others refuse sparse gradients here
SPARSE_REFUSED = [lvl for lvl in LEVELS if lvl not in SPARSE_LEVELS]


def backward(loss, opt, amp):
    """``loss.backward()``, through ``ampkit.scale_loss`` when ``amp`` (the fp32 reference has none)."""
    if not amp:
        loss.backward()
        return
    with ampkit.scale_loss(loss, opt) as scaled:
        scaled.backward()


@pytest.mark.parametrize("level", SPARSE_REFUSED)
def test_sparse_embeddings_refused_where_torch_cannot_add_their_half_gradients(level):
    torch.manual_seed(0)
    model = Bag()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"emb.weight has sparse gradients \(sparse=True\), and PyTorch cannot add "
                                         r"sparse torch.float16 gradients on cpu"):
        ampkit.initialize(model, opt, opt_level=level, verbosity=0)
    assert not hasattr(model, "_ampkit") and not hasattr(opt, "_ampkit")
    assert all(torch.equal(v, before[k]) and v.dtype == before[k].dtype for k, v in model.state_dict().items())


@pytest.mark.parametrize("kind", ["sgd", "sparse_adam"])
@pytest.mark.parametrize("level", SPARSE_LEVELS)
def test_sparse_embedding_gradients_train_like_float32(level, kind):
    _, ref = _train_bag(None, kind)
    model, ours = _train_bag(level, kind)
    assert model.emb.weight.dtype == (HALF[level] if level in ("O2", "O3", "O5") else torch.float32)
    for k, v in ours[-1].items():
        torch.testing.assert_close(v, ref[-1][k], **TOL[HALF[level]], msg=k)


@pytest.mark.parametrize("kind", ["sgd", "sparse_adam"])
@pytest.mark.parametrize("level", SPARSE_LEVELS)
def test_an_overflowing_sparse_gradient_skips_the_step(level, kind):
    _, seen = _train_bag(level, kind, overflow_at=2)
    assert all(torch.equal(seen[1][k], seen[2][k]) for k in seen[1])
    assert current_run("test").scalers[0].skipped_steps == 1
    assert all(torch.isfinite(v).all() for v in seen[-1].values())


def test_sparse_gradients_match_torch_grad_scaler():
    torch.manual_seed(0)
    model = Bag()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    scaler = torch.amp.GradScaler("cpu")
    for idx, y in _batches():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(idx)
        scaler.scale(nn.functional.mse_loss(out.float(), y)).backward()
        scaler.step(opt)
        scaler.update()
    ours, _ = _train_bag("O1", "sgd")
    for (k, v), r in zip(ours.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(v, r, rtol=1e-6, atol=1e-7, msg=k)


class Phase(nn.Module):
    """A real layer followed by a complex parameter."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.w = nn.Parameter(torch.randn(3, dtype=torch.complex64))

    def forward(self, x):
        return (self.fc(x).to(self.w.dtype) * self.w).abs()


@pytest.mark.parametrize("level", LEVELS)
def test_complex_parameters_train_like_float32(level):
    results = []
    for lvl in (None, level):
        torch.manual_seed(0)
        model = Phase()
        opt = torch.optim.Adam(model.parameters(), lr=0.05, eps=1e-3)
        if lvl is not None:
            model, opt = ampkit.initialize(model, opt, opt_level=lvl, verbosity=0)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            x, y = torch.randn(8, 4, generator=g), torch.rand(8, 3, generator=g)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            backward(loss, opt, amp=lvl is not None)
            opt.step()
        results.append(model.state_dict())
    ref, ours = results
    assert ours["w"].dtype == torch.complex64
    for k, v in ours.items():
        torch.testing.assert_close(v, ref[k], **TOL[HALF[level]], msg=k)


def test_closure_optimizers_are_refused_at_initialize():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.LBFGS(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"LBFGS.step\(closure\) needs a closure"):
        ampkit.initialize(model, opt, opt_level="O2", verbosity=0)
    assert not hasattr(model, "_ampkit") and not hasattr(opt, "_ampkit")
    assert all(torch.equal(a, b) and b.dtype == torch.float32 for a, b in zip(before, model.parameters()))


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 3)
        self.unused = nn.Linear(2, 2)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


@pytest.mark.parametrize("level", LEVELS)
def test_zero_grad_set_to_none_false_zero_fills_masters_too(level):
    runs = []
    for lvl in (None, level):
        torch.manual_seed(0)
        model = WithUnused()
        # weight decay: a zero-filled gradient decays the weight, a None one leaves it alone
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
        if lvl is not None:
            model, opt = ampkit.initialize(model, opt, opt_level=lvl, verbosity=0)
        g = torch.Generator().manual_seed(1)
        grads = []
        for _ in range(3):
            opt.zero_grad(set_to_none=False)
            grads.append([None if p.grad is None else p.grad.clone() for p in ampkit.master_params(opt)])
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
            loss = nn.functional.mse_loss(model(x), y)
            backward(loss, opt, amp=lvl is not None)
            opt.step()
        runs.append((grads, model.state_dict()))
    (ref_grads, ref_sd), (grads, sd) = runs
    for ref_step, step in zip(ref_grads, grads):
        assert [g is None for g in ref_step] == [g is None for g in step]  # unused layer: still None
        stepped = [p.dtype for p in ampkit.master_params(opt)]  # fp32 masters, or half params at O3
        assert all(g is None or (g.dtype == d and not g.any()) for g, d in zip(step, stepped))
    for k, v in sd.items():
        torch.testing.assert_close(v, ref_sd[k], **TOL[HALF[level]], msg=k)


@pytest.mark.parametrize("level", SPARSE_LEVELS)
def test_sparse_gradients_accumulate_over_two_backwards(level):
    """Two scale_loss calls before one step == one backward of the summed loss."""
    results = []
    for split in (True, False):
        torch.manual_seed(0)
        model = Bag()
        opt = torch.optim.SGD(model.parameters(), lr=0.2)
        model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0)
        (i1, y1), (i2, y2) = _batches(2)
        losses = [nn.functional.mse_loss(model(i1), y1), nn.functional.mse_loss(model(i2), y2)]
        for loss in (losses if split else [losses[0] + losses[1]]):
            with ampkit.scale_loss(loss, opt) as s:
                s.backward()
        opt.step()
        results.append(model.state_dict())
    for k, v in results[0].items():
        torch.testing.assert_close(v, results[1][k], **TOL[HALF[level]], msg=k)
