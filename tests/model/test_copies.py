"""Copies of an initialized model (EMA, SWA, teachers) against the same loop in float32:
``copy.deepcopy`` + timm's in-place update over ``state_dict().values()``,
``AveragedModel`` (EMA and SWA), plain teacher copies, and checkpoints of them."""
import copy
import io

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import ampkit

LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
HALF = {"O0": torch.float32, "O1": torch.float16, "O2": torch.float16, "O3": torch.float16,
        "O4": torch.bfloat16, "O5": torch.bfloat16}
DECAY = 0.9
STEPS = 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def batches():
    g = torch.Generator().manual_seed(1)
    return [(0.5 * torch.randn(16, 4, generator=g), 0.5 * torch.randn(16, 3, generator=g)) for _ in range(STEPS)]


def timm_update(ema, model):
    with torch.no_grad():
        for e, m in zip(ema.state_dict().values(), model.state_dict().values()):
            e.copy_(e * DECAY + (1.0 - DECAY) * m)


def train(level, idiom):
    """Train Net for STEPS steps (at ``level``, or in plain float32 when None) with an
    EMA/SWA copy kept by ``idiom``; returns (model, copy)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if level is not None:
        model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0)
    if idiom == "timm":
        shadow = copy.deepcopy(model)
    elif idiom == "ema":
        shadow = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))
    else:
        shadow = AveragedModel(model)  # SWA: the running mean
    for x, y in batches():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if level is None:
            loss.backward()
        else:
            with ampkit.scale_loss(loss, opt) as s:
                s.backward()
        opt.step()
        if idiom == "timm":
            timm_update(shadow, model)
        else:
            shadow.update_parameters(model)
    return model, shadow


def tol(level):
    # a few steps of half-precision training and a half-precision forward
    return {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float16: dict(rtol=2e-3, atol=2e-3),
            torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}[HALF[level]]


@pytest.mark.parametrize("idiom", ["timm", "ema", "swa"])
@pytest.mark.parametrize("level", LEVELS)
def test_ema_and_swa_copies_match_the_float32_loop(level, idiom):
    _, ref = train(None, idiom)
    model, ours = train(level, idiom)
    sd, ref_sd = ours.state_dict(), ref.state_dict()
    assert sd.keys() == ref_sd.keys()
    for k, v in sd.items():
        assert v.dtype == ref_sd[k].dtype, k  # float32 (and int64 counters), at every level
        torch.testing.assert_close(v, ref_sd[k], **tol(level), msg=k)
    ours.eval(), ref.eval()
    x = batches()[0][0]
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), **tol(level))
    # a checkpoint of the copy: a plain float32 file that a plain model loads
    buf = io.BytesIO()
    torch.save(ours.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in sd.items())
    plain = copy.deepcopy(ref)
    plain.load_state_dict(loaded)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), ref(x), **tol(level))


@pytest.mark.parametrize("level", LEVELS)
def test_timm_ema_moves_in_float32(level):
    """An EMA step far below the half dtype's resolution still moves the copy's state_dict."""
    model, ema = train(level, "timm")
    before = {k: v.clone() for k, v in ema.state_dict().items()}
    with torch.no_grad():
        for e, m in zip(ema.state_dict().values(), model.state_dict().values()):
            if e.is_floating_point():
                e.copy_(e * 0.9999 + 0.0001 * (m + 1.0))
    moved = ema.state_dict()["fc1.weight"] - before["fc1.weight"]
    torch.testing.assert_close(moved, 0.0001 * (model.state_dict()["fc1.weight"] + 1.0 - before["fc1.weight"]),
                               rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize("level", LEVELS)
def test_a_copy_has_masters_of_its_own(level):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0)
    model.eval()
    x, y = batches()[0]
    teacher = copy.deepcopy(model)
    frozen = {k: v.clone() for k, v in model.state_dict().items()}
    out = model(x).detach()
    for _ in range(2):  # the original trains on; the teacher keeps the values it was copied with
        opt.zero_grad()
        with ampkit.scale_loss(nn.functional.mse_loss(model(x), y), opt) as s:
            s.backward()
        opt.step()
    assert all(torch.equal(teacher.state_dict()[k], v) for k, v in frozen.items())
    assert torch.equal(teacher(x), out)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    assert not torch.equal(trained["fc1.weight"], frozen["fc1.weight"])
    torch.testing.assert_close(trained["fc1.weight"], model.fc1.weight.float(), **tol(level))
    with torch.no_grad():  # writing into the teacher leaves the original alone, and vice versa
        for v in teacher.state_dict().values():
            v.zero_()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.items())
    assert not torch.equal(teacher(x), out)
    teacher.load_state_dict(frozen)
    assert torch.equal(teacher(x), out)
    assert all(torch.equal(teacher.state_dict()[k], v) for k, v in frozen.items())


@pytest.mark.parametrize("level", ["O2", "O3", "O5"])
def test_state_dict_values_per_level(level):
    """The documented contract: float32 values everywhere; the training model's are aliases
    of its masters (O2/O5) or float32 copies (O3); a copy's are aliases of its own float32
    weights."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0)
    sd = model.state_dict()
    masters = list(ampkit.master_params(opt))
    if level == "O3":
        assert sd["fc1.weight"].data_ptr() != model.fc1.weight.data_ptr()
    else:
        assert any(sd["fc1.weight"].data_ptr() == m.data_ptr() for m in masters)
    assert all(v.dtype in (torch.float32, torch.int64) for v in sd.values())
    ema = copy.deepcopy(model)
    a, b = ema.state_dict(), ema.state_dict()
    assert all(a[k].data_ptr() == b[k].data_ptr() for k in a)


@pytest.mark.parametrize("file, path", [("o2_model_v0.2.0.pkl", b"ampkit.model_state"),
                                        ("o2_model_v0.3.0.dev.pkl", b"ampkit.install.model_state")])
def test_a_model_pickled_by_an_earlier_layout_still_loads(file, path):
    """Sequential(Linear(4, 4), BatchNorm1d(4), LayerNorm(4)) after ``initialize(..., opt_level="O2")``,
    pickled by the flat-layout ampkit 0.2.0 (it names ``ampkit.model_state._rebuild`` and the hooks
    there) and by a 0.3.0 development build (``ampkit.install.model_state``)."""
    import pickle
    from pathlib import Path

    data = (Path(__file__).with_name("data") / file).read_bytes()
    assert path in data
    model = pickle.loads(data)
    assert model[0].weight.dtype == torch.float16 and model[1].weight.dtype == torch.float32
    out = model(torch.randn(2, 4))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


def test_a_model_pickles_under_public_paths_only():
    """New pickles name ``ampkit.model_state`` and ``ampkit.normalization.batchnorm``, never a private
    package, so they load after the internals move again."""
    import pickle
    import re

    model = ampkit.initialize(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), opt_level="O2", verbosity=0)
    data = pickle.dumps(model)
    assert set(re.findall(rb"ampkit[\w.]*", data)) == {b"ampkit", b"ampkit.model_state", b"ampkit.normalization.batchnorm"}
    again = pickle.loads(data)
    assert again[0].weight.dtype == torch.float16 and again.state_dict()["0.weight"].dtype == torch.float32


@pytest.mark.parametrize("idiom", ["ema", "timm"])
@pytest.mark.parametrize("level", ["O0", "O2", "O3", "O5", "O7", "O8", "remainder"])
def test_a_copy_resumed_from_its_state_dict_goes_on_bit_for_bit(level, idiom):
    """An EMA saved, loaded into a fresh copy (and into itself), then updated: every later
    ``state_dict()`` equals the uninterrupted EMA's exactly (the first update after the load
    used to be dropped)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kw = dict(opt_level="O5", master_weights="remainder") if level == "remainder" else dict(opt_level=level)
    model, opt = ampkit.initialize(model, opt, verbosity=0, **kw)

    def shadow():
        if idiom == "timm":
            return copy.deepcopy(model)
        return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))

    def update(ema):
        timm_update(ema, model) if idiom == "timm" else ema.update_parameters(model)

    dtype = next(model.parameters()).dtype
    kept, resumed, reloaded = shadow(), None, None
    for i, (x, y) in enumerate(batches()):
        opt.zero_grad()
        with ampkit.scale_loss(nn.functional.mse_loss(model(x.to(dtype)).float(), y), opt) as s:
            s.backward()
        opt.step()
        for ema in (kept, resumed, reloaded):
            if ema is not None:
                update(ema)
        if i == 1:
            saved = copy.deepcopy(kept.state_dict())
            resumed, reloaded = shadow(), kept
            kept = copy.deepcopy(kept)  # the uninterrupted one goes on without any load
            resumed.load_state_dict(saved)
            reloaded.load_state_dict(saved)
    want = kept.state_dict()
    for ema in (resumed, reloaded):
        got = ema.state_dict()
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
        assert not torch.equal(got["fc2.weight" if idiom == "timm" else "module.fc2.weight"],
                               saved["fc2.weight" if idiom == "timm" else "module.fc2.weight"])
