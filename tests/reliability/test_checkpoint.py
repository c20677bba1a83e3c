"""``ampkit.checkpoint``: truncated, corrupted or mismatched files give a clear error and
leave model, optimizer and loss scalers exactly as they were; never a half-loaded model."""
import ctypes
import os

import pytest
import torch

import ampkit
from ampkit import checkpoint
from ampkit.checkpoint import CheckpointError

from ._harness import Poison, Tiny, assert_unchanged, fixed_batch, make, snapshot, train


def _trained(level="O2", opt_name="adamw", steps=5, seed=0, num_losses=1, **kw):
    x, y = fixed_batch()
    model, opt = make(opt_name, seed=seed)
    model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0, num_losses=num_losses, **kw)
    poison = Poison(model.fc1.weight)
    train(model, opt, x, y, steps, {(1, 0): "inf"}, num_losses=num_losses, poison=poison)
    return model, opt


def _full(model, opt):
    snap = snapshot(model, opt, grads=True)
    snap["amp"] = [repr(s.state_dict()) for s in opt._ampkit.run.scalers]
    return snap


def _content(snap):
    """The values a checkpoint carries (not object identities, hooks or gradients)."""
    return {
        "params": [e[:3] for e in snap["model.params"]],
        "buffers": snap["model.buffers"],
        "stepped": snap["opt.params"],
        "state": snap["opt.state"],
        "hyper": [g[1] for g in snap["opt.groups"]],
        "amp": snap["amp"],
    }


@pytest.fixture
def saved(tmp_path):
    model, opt = _trained(steps=6, seed=0)
    path = tmp_path / "good.ckpt"
    checkpoint.save(path, model, opt, extra={"step": 6, "note": "x"})
    return path, _full(model, opt)


@pytest.fixture
def target():
    """A differently trained run of the same setup: the thing a bad load must not touch."""
    model, opt = _trained(steps=3, seed=5)
    return model, opt, _full(model, opt)


@pytest.mark.parametrize("level", ["O0", "O2", "O3", "O5"])
def test_round_trip_is_bit_exact_and_a_plain_torch_file(level, tmp_path):
    model, opt = _trained(level, steps=6, seed=0, num_losses=2)
    path = tmp_path / "c.ckpt"
    checkpoint.save(path, model, opt, extra={"step": 6})
    other, oopt = _trained(level, steps=2, seed=3, num_losses=2)
    assert checkpoint.load(path, other, oopt) == {"step": 6}
    assert_unchanged(_content(_full(model, opt)), _content(_full(other, oopt)), "loaded vs saved")
    plain = torch.load(path, weights_only=True)["model"]  # readable without ampkit
    fresh = Tiny()
    fresh.load_state_dict(plain)
    assert all(v.dtype == torch.float32 for v in plain.values())
    assert [p.name for p in tmp_path.iterdir()] == ["c.ckpt"]  # no temporary file left behind


def test_truncated_files_are_refused_and_change_nothing(saved, target, tmp_path):
    path, _ = saved
    data = path.read_bytes()
    model, opt, before = target
    for n in sorted({0, 1, 10, 100, len(data) // 3, len(data) // 2, len(data) - 100, len(data) - 1}):
        bad = tmp_path / f"cut{n}.ckpt"
        bad.write_bytes(data[:n])
        with pytest.raises(CheckpointError, match=r"not a readable checkpoint.*truncated or corrupted"):
            checkpoint.load(bad, model, opt)
        assert_unchanged(before, _full(model, opt), f"load of a file cut at {n} bytes")
    assert checkpoint.load(path, model, opt)["step"] == 6  # and the good file still loads into it


def _tensor_offsets(data: bytes, saved_model: dict):
    """Byte offsets inside the file where the raw bytes of saved tensors lie."""
    out = []
    for v in saved_model.values():
        t = v.contiguous()
        blob = ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())
        at = data.find(blob)
        if at >= 0:
            out += [at, at + len(blob) // 2, at + len(blob) - 1]
    return out


# A flipped byte in the pickle reaches torch's weights-only unpickler, whose allow-list check on a
# corrupted REDUCE (``func not in _get_allowed_globals().values()``) warns from inside torch about a
# plain-method __torch_function__; ampkit then refuses the file, which is what the test checks.
@pytest.mark.filterwarnings("ignore:Defining your `__torch_function__` as a plain method is deprecated:UserWarning")
def test_flipped_bytes_are_detected_or_harmless(saved, target, tmp_path):
    path, saved_state = saved
    data = path.read_bytes()
    model, opt, before = target
    inside = _tensor_offsets(data, torch.load(path, weights_only=True)["model"])
    assert len(inside) >= 6
    positions = sorted(set(inside + list(range(0, len(data), max(1, len(data) // 60)))))
    refused = harmless = 0
    for i in positions:
        b = bytearray(data)
        b[i] ^= 0x5A
        bad = tmp_path / "flip.ckpt"
        bad.write_bytes(bytes(b))
        try:
            checkpoint.load(bad, model, opt)
        except CheckpointError as e:
            refused += 1
            assert "corrupted" in str(e) or "not an ampkit checkpoint" in str(e), str(e)
            assert_unchanged(before, _full(model, opt), f"refused load, byte {i} flipped")
            if i in inside:
                assert "SHA-256" in str(e)
        else:
            # The flip hit bytes torch.load never reads (zip padding, a local header's CRC):
            # then what loaded must be exactly what was saved.
            harmless += 1
            assert i not in inside, f"flipped tensor byte {i} loaded silently"
            assert_unchanged(_content(saved_state), _content(_full(model, opt)), f"load with byte {i} flipped")
            model, opt = _trained(steps=3, seed=5)  # a fresh target for the next flips
            before = _full(model, opt)
    assert refused >= len(inside) and refused + harmless == len(positions)


def test_not_an_ampkit_checkpoint(target, tmp_path):
    model, opt, before = target
    bad = tmp_path / "plain.pt"
    torch.save(model.state_dict(), bad)
    with pytest.raises(CheckpointError, match="not an ampkit checkpoint"):
        checkpoint.load(bad, model, opt)
    assert_unchanged(before, _full(model, opt), "load of a plain state dict")
    with pytest.raises(FileNotFoundError):
        checkpoint.load(tmp_path / "missing.ckpt", model, opt)


def test_checkpoint_of_another_setup_is_refused(tmp_path, target):
    model, opt, before = target

    class Wider(Tiny):
        def __init__(self):
            super().__init__(dh=7)

    torch.manual_seed(0)
    wide = Wider()
    wopt = torch.optim.AdamW(wide.parameters(), lr=1e-2)
    wide, wopt = ampkit.initialize(wide, wopt, opt_level="O2", verbosity=0)
    checkpoint.save(tmp_path / "wide.ckpt", wide, wopt)
    with pytest.raises(CheckpointError, match=r"model\['fc1.weight'\] has shape \(7, 4\), the model has \(6, 4\)"):
        checkpoint.load(tmp_path / "wide.ckpt", model, opt)
    two, topt = _trained(steps=2, num_losses=2)
    checkpoint.save(tmp_path / "two.ckpt", two, topt)
    with pytest.raises(CheckpointError, match=r"num_losses=1"):
        checkpoint.load(tmp_path / "two.ckpt", model, opt)
    assert_unchanged(before, _full(model, opt), "refused loads")


def test_failure_while_applying_rolls_everything_back(saved, target, monkeypatch):
    path, _ = saved
    model, opt, before = target

    real, calls = type(opt).load_state_dict, []

    def broken(self, state_dict):  # fails once: after the model was already loaded
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("disk hiccup")
        return real(self, state_dict)

    monkeypatch.setattr(type(opt), "load_state_dict", broken)
    with pytest.raises(CheckpointError, match="applying the checkpoint failed, nothing was changed.*disk hiccup"):
        checkpoint.load(path, model, opt)
    monkeypatch.undo()
    assert len(calls) == 2  # the failed apply, then the rollback
    assert_unchanged(before, _full(model, opt), "rolled-back load")


@pytest.mark.parametrize("at", ["optimizer", "scaler"])
def test_keyboard_interrupt_while_applying_rolls_everything_back(saved, target, monkeypatch, at):
    """Ctrl-C after the model (and the optimizer) were loaded: all restored, and the
    KeyboardInterrupt itself reaches the caller."""
    path, _ = saved
    model, opt, before = target
    cls, name = (type(opt), "load_state_dict") if at == "optimizer" else (ampkit.LossScaler, "load_state_dict")
    real, calls = getattr(cls, name), []

    def interrupted(self, state_dict):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(self, state_dict)

    monkeypatch.setattr(cls, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.load(path, model, opt)
    monkeypatch.undo()
    assert_unchanged(before, _full(model, opt), "interrupted load")


def test_plain_extras_round_trip(tmp_path):
    model, opt = _trained(steps=1)
    extra = {"step": 7, "lr": 1e-3, "name": "run", "blob": b"\x00", "none": None, "flag": True, "z": 1j,
             "nested": {"list": [1, 2.5, "a"], "tuple": (3, 4)}, "t": torch.arange(3), "dtype": torch.bfloat16,
             "device": torch.device("cpu"), "shape": torch.Size([2, 3]), 5: "int key"}
    checkpoint.save(tmp_path / "c.ckpt", model, opt, extra=extra)
    back = checkpoint.load(tmp_path / "c.ckpt", model, opt)
    assert back.keys() == extra.keys() and torch.equal(back.pop("t"), extra.pop("t")) and back == extra
    assert torch.load(tmp_path / "c.ckpt", weights_only=True)["extra"]["step"] == 7


def _extras():
    import argparse
    import pathlib

    out = [({"out": pathlib.Path("/tmp/run")}, r"extra\['out'\] is a pathlib\.\w*Path.*str\(path\)"),
           ({"args": argparse.Namespace(lr=0.1)}, r"extra\['args'\] is a argparse\.Namespace.*vars\(args\)"),
           ({"hist": [1, {2, 3}]}, r"extra\['hist'\]\[1\] is a builtins\.set.*sorted\(x\)"),
           ({"cfg": {"when": __import__("datetime").date(2024, 1, 1)}}, r"extra\['cfg'\]\['when'\] is a datetime\.date")]
    # numpy.float64 subclasses float: a float subclass stands in for it where numpy is absent
    out.append(({"best": type("float64", (float,), {"item": lambda self: float(self)})(0.5)},
                r"extra\['best'\] is a .*float64.*x\.item\(\)"))
    try:
        import numpy as np
    except ImportError:  # numpy is not a dependency; its own scalars are checked where it is installed
        return out
    return out + [({"best": np.float64(0.5)}, r"extra\['best'\] is a numpy\.float64.*x\.item\(\)"),
                  ({"epoch": np.int64(3)}, r"extra\['epoch'\] is a numpy\.int64")]


@pytest.mark.parametrize("extra,message", _extras())
def test_extras_torch_load_cannot_read_are_refused_before_writing(saved, extra, message):
    path, _ = saved
    old = path.read_bytes()
    model, opt = _trained(steps=1)
    with pytest.raises(TypeError, match=message + ".*Nothing was written"):
        checkpoint.save(path, model, opt, extra=extra)
    with pytest.raises(TypeError, match=message):
        checkpoint.save(path.with_name("new.ckpt"), model, opt, extra=extra)
    assert path.read_bytes() == old and sorted(p.name for p in path.parent.iterdir()) == ["good.ckpt"]


def test_a_failed_save_keeps_the_previous_file(saved, monkeypatch):
    path, _ = saved
    model, opt = _trained(steps=2, seed=9)
    old = path.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(path, model, opt)
    monkeypatch.undo()
    assert path.read_bytes() == old
    assert sorted(p.name for p in path.parent.iterdir()) == ["good.ckpt"]


def _save_with_generators(monkeypatch, path, model, opt, generators):
    """A checkpoint in the layout of versions whose O7/O8 rounder also saved generator states."""
    from ampkit._kernels.rounding import StochasticRounder

    real = StochasticRounder.state_dict
    monkeypatch.setattr(StochasticRounder, "state_dict", lambda self: {**real(self), "generators": generators})
    checkpoint.save(path, model, opt)
    monkeypatch.undo()


def test_an_old_o7_checkpoint_with_generator_states_loads_its_seed_and_step(tmp_path, monkeypatch):
    model, opt = _trained("O7", steps=4, seed=0)
    ampkit.stochastic_rounding.manual_seed(9, opt)
    train(model, opt, *fixed_batch(), 2)
    saved = opt._ampkit.run.rounder.state_dict()
    assert saved == {"seed": 9, "step": 2}
    _save_with_generators(monkeypatch, tmp_path / "old.ckpt", model, opt, {"cpu": torch.Generator().get_state()})
    assert "generators" in torch.load(tmp_path / "old.ckpt", weights_only=True)["amp"]["stochastic_rounding"]
    other, oopt = _trained("O7", steps=3, seed=5)
    checkpoint.load(tmp_path / "old.ckpt", other, oopt)
    assert oopt._ampkit.run.rounder.state_dict() == saved
    assert_unchanged(_content(_full(model, opt)), _content(_full(other, oopt)), "loaded vs saved")


def test_an_old_checkpoint_with_a_malformed_generator_state_is_refused_and_changes_nothing(tmp_path, monkeypatch):
    model, opt = _trained("O7", steps=2, seed=0)
    _save_with_generators(monkeypatch, tmp_path / "bad.ckpt", model, opt, {"cpu": torch.zeros(3)})
    other, oopt = _trained("O7", steps=3, seed=5)
    before, rounding = _full(other, oopt), oopt._ampkit.run.rounder.state_dict()
    with pytest.raises(CheckpointError, match=r"stochastic_rounding\['generators'\]\['cpu'\]: expected a generator state"):
        checkpoint.load(tmp_path / "bad.ckpt", other, oopt)
    assert_unchanged(before, _full(other, oopt), "refused load")
    assert oopt._ampkit.run.rounder.state_dict() == rounding
