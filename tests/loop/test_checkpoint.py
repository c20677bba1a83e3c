"""Checkpoints lose nothing: float32 model state dicts at every level, loads that re-sync the
fp32 masters, optimizer and loss-scaler state, Apex-format scaler state, clear errors that
change nothing, and bit-exact resume (in-process at O0-O5, in a real subprocess at O2/O5)."""
import collections
import copy
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import ampkit
from ampkit._run.registry import current as current_run
from ampkit.surgery import replace_module_classes

from . import _resume_worker as worker

LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
CAST = {"O0": torch.float32, "O1": torch.float32, "O2": torch.float16, "O3": torch.float16, "O4": torch.float32, "O5": torch.bfloat16}
MASTERED = {"O2", "O5"}
# Output agreement between the initialized model and a plain fp32 model holding its checkpoint.
OUT_TOL = {"O0": 0.0, "O1": 1e-2, "O2": 1e-2, "O3": 1e-2, "O4": 6e-2, "O5": 6e-2}
WORKER = Path(worker.__file__).resolve()
ROOT = WORKER.parents[2]


Net = worker.Net


def trained(level, steps=3):
    model, opt = worker.build(level)
    worker.train(model, opt, 0, steps)
    return model, opt


def disk(obj):
    """A torch.save / torch.load(weights_only=True) round trip, as a checkpoint file makes."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def same(a, b, path="x"):
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    else:
        assert a == b, path


def raw(model, opt):
    """Model parameters and buffers as they are (not the float32 state dict), masters, optimizer."""
    return copy.deepcopy({
        "params": [p.detach() for p in model.parameters()],
        "buffers": [b.detach() for b in model.buffers()],
        "masters": [m.detach() for m in ampkit.master_params(opt)],
        "optimizer": opt.state_dict(),
    })


# --- model.state_dict() is float32 at every level ----------------------------------------

@pytest.mark.parametrize("level", LEVELS)
def test_state_dict_is_float32_and_loads_into_a_plain_fp32_model(level):
    model, opt = trained(level)
    sd = model.state_dict()
    plain = Net()
    assert list(sd) == list(plain.state_dict())
    for k, v in sd.items():
        assert v.dtype == (torch.int64 if k.endswith("num_batches_tracked") else torch.float32), k
    assert model.fc1.weight.dtype == CAST[level]
    if level in MASTERED:
        masters = opt._ampkit.masters
        for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
            p = model.get_parameter(name)
            assert torch.equal(sd[name], masters[p]), name  # the master itself, not the half copy
        # ...which holds more than the half parameter does: saving p.float() would lose it.
        assert not torch.equal(sd["fc1.weight"], model.fc1.weight.float())
    else:
        for name, p in model.named_parameters():
            assert torch.equal(sd[name], p.float()), name
    loaded = disk(sd)
    plain.load_state_dict(loaded)
    x = worker.batch(50)[0]
    model.eval()
    plain.eval()
    with torch.no_grad():
        mine, theirs = model(x), plain(x)
    assert mine.dtype == torch.float32
    torch.testing.assert_close(mine, theirs, rtol=OUT_TOL[level], atol=OUT_TOL[level])


def test_keep_vars_returns_the_tensors_themselves():
    model, opt = trained("O2", steps=1)
    sd = model.state_dict(keep_vars=True)
    assert sd["fc1.weight"] is model.fc1.weight and sd["fc1.weight"].dtype == torch.float16
    assert sd["bn.running_mean"] is model.bn.running_mean


def test_nested_and_submodule_state_dicts_report_masters():
    model, opt = trained("O2")
    master = opt._ampkit.masters[model.fc1.weight]
    outer = nn.Sequential(model)
    sd = outer.state_dict()
    assert torch.equal(sd["0.fc1.weight"], master) and sd["0.fc1.weight"].dtype == torch.float32
    assert torch.equal(model.fc1.state_dict()["weight"], master)
    new = {k: (v + 0.25 if v.is_floating_point() else v) for k, v in sd.items()}
    outer.load_state_dict(new)
    assert torch.equal(master, new["0.fc1.weight"])  # loading through the container re-syncs the master
    assert torch.equal(model.fc1.weight, new["0.fc1.weight"].half())


def test_surgery_after_initialize_keeps_checkpoints_going_through_the_masters():
    model, opt = trained("O2")

    def fresh_linear(module, name):
        new = nn.Linear(module.in_features, module.out_features, dtype=module.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(module.weight)
            new.bias.copy_(module.bias)
        return new

    master = opt._ampkit.masters[model.fc1.weight]
    kept = master.detach().clone()
    replace_module_classes(model, {nn.Linear: fresh_linear}, opt)
    assert opt._ampkit.masters[model.fc1.weight] is master
    assert torch.equal(master, kept)  # same rounded values: the fp32 master keeps its precision
    sd = model.state_dict()
    assert sd["fc1.weight"].dtype == torch.float32 and torch.equal(sd["fc1.weight"], master)
    new = {k: (v * 0.5 if v.is_floating_point() else v) for k, v in sd.items()}
    model.load_state_dict(new)
    assert torch.equal(master, new["fc1.weight"]) and torch.equal(model.fc1.weight, new["fc1.weight"].half())


# --- load_state_dict after initialize -------------------------------------------------------

@pytest.mark.parametrize("half_input", [False, True])
@pytest.mark.parametrize("level", LEVELS)
def test_load_after_initialize_then_zero_lr_step_keeps_the_loaded_weights(level, half_input):
    torch.manual_seed(5)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
    model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0)
    if current_run("t").scalers[0].dynamic:
        ampkit.load_state_dict({"loss_scaler0": {"loss_scale": 256.0, "unskipped": 0}}, optimizer=opt)
    worker.train(model, opt, 2, 3)  # some history (momentum) first; lr=0 changes nothing
    torch.manual_seed(6)
    source = Net()
    for p in source.parameters():  # full float32 precision, far from the model's values
        p.data.normal_()
    sd = source.state_dict()
    if half_input:
        sd = {k: (v.half() if v.is_floating_point() else v) for k, v in sd.items()}
    before = [p.detach().clone() for p in model.parameters()]
    model.load_state_dict(sd)
    assert not any(torch.equal(p, b) for p, b in zip(model.parameters(), before))

    def check(buffers):
        for name, p in model.named_parameters():
            assert p.dtype == (CAST[level] if not name.startswith("bn") or level == "O3" else torch.float32), name
            assert torch.equal(p, sd[name].to(p.dtype)), name
            if p in opt._ampkit.masters:
                assert torch.equal(opt._ampkit.masters[p], sd[name].float()), name  # exact, not via half
        out = model.state_dict()
        for name in sd:
            if name.endswith("num_batches_tracked") or ("running" in name and not buffers):
                continue  # training updates BatchNorm statistics
            held = model.get_parameter(name) if "running" not in name else model.get_buffer(name)
            if level in MASTERED and held in opt._ampkit.masters or held.dtype == torch.float32:
                assert torch.equal(out[name], sd[name].float()), name
            else:
                assert torch.equal(out[name], sd[name].to(held.dtype).float()), name

    check(buffers=True)
    worker.train(model, opt, 3, 5)  # two zero-LR steps: the loaded weights must survive them
    check(buffers=False)


def test_load_state_dict_with_assign_is_refused_and_changes_nothing():
    model, opt = trained("O2", steps=1)
    snap = raw(model, opt)
    with pytest.raises(ValueError, match=r"assign=True.*master weights"):
        model.load_state_dict(Net().state_dict(), assign=True)
    same(raw(model, opt), snap)


def bad_state_dicts():
    good = Net().state_dict()
    cases = {}
    d = collections.OrderedDict(good)
    del d["fc2.bias"]
    cases["missing"] = d
    d = collections.OrderedDict(good)
    d["fc3.weight"] = torch.zeros(2)
    d["scale"] = torch.ones(1)
    cases["unexpected"] = d
    d = collections.OrderedDict(good)
    del d["fc1.weight"]
    d["fc1.weight_v"] = torch.zeros(1)
    cases["missing_and_unexpected"] = d
    d = collections.OrderedDict(good)
    d["fc1.weight"] = torch.zeros(8, 4)
    cases["size_mismatch"] = d
    d = collections.OrderedDict(good)
    d["fc2.bias"] = [0.0, 0.0]
    cases["not_a_tensor"] = d
    d = copy.copy(good)  # keeps _metadata (BatchNorm version 2): num_batches_tracked is required
    del d["bn.num_batches_tracked"]
    cases["missing_num_batches_tracked"] = d
    return cases


@pytest.mark.parametrize("case", sorted(bad_state_dicts()))
@pytest.mark.parametrize("level", ["O2", "O3", "O5"])
def test_bad_model_state_dict_gives_pytorchs_message_and_changes_nothing(level, case):
    sd = bad_state_dicts()[case]
    with pytest.raises(RuntimeError) as plain_error:
        Net().load_state_dict(sd)
    model, opt = trained(level, steps=2)
    snap = raw(model, opt)
    with pytest.raises(RuntimeError) as error:
        model.load_state_dict(sd)
    assert str(error.value) == str(plain_error.value)
    same(raw(model, opt), snap)  # parameters, buffers, masters, optimizer: untouched


def test_old_checkpoint_without_num_batches_tracked_still_loads():
    """Without metadata (an old or hand-made dict) PyTorch fills num_batches_tracked in; so do we."""
    model, opt = trained("O2", steps=1)
    sd = {k: v for k, v in Net().state_dict().items() if not k.endswith("num_batches_tracked")}
    model.load_state_dict(sd)
    assert torch.equal(opt._ampkit.masters[model.fc1.weight], sd["fc1.weight"])


def test_non_strict_load_reports_like_pytorch_and_syncs_what_it_loads():
    model, opt = trained("O2", steps=1)
    sd = Net().state_dict()
    del sd["fc2.weight"]
    sd["extra"] = torch.zeros(1)
    expected = Net().load_state_dict(sd, strict=False)
    fc2 = opt._ampkit.masters[model.fc2.weight].detach().clone()
    result = model.load_state_dict(sd, strict=False)
    assert result.missing_keys == expected.missing_keys and result.unexpected_keys == expected.unexpected_keys
    assert torch.equal(opt._ampkit.masters[model.fc1.weight], sd["fc1.weight"])
    assert torch.equal(opt._ampkit.masters[model.fc2.weight], fc2)


# --- optimizer and loss-scaler state ---------------------------------------------------------

@pytest.mark.parametrize("level", ["O2", "O5"])
def test_optimizer_state_dict_round_trips_the_fp32_master_state(level):
    model, opt = trained(level)
    osd = opt.state_dict()
    assert len(osd["state"]) == 6
    for i, st in osd["state"].items():
        assert st["exp_avg"].dtype == torch.float32 and st["exp_avg_sq"].dtype == torch.float32, i
        assert st["step"].item() == 2  # three steps, one of them skipped (overflow)
    assert osd["state"][0]["exp_avg"].shape == model.fc1.weight.shape
    loaded = disk(osd)
    model2, opt2 = worker.build(level, seed=99)
    opt2.load_state_dict(loaded)
    same(opt2.state_dict(), osd)
    masters2 = list(ampkit.master_params(opt2))
    assert set(map(id, opt2.state)) == set(map(id, masters2))  # keyed by the new masters
    assert opt2.state[masters2[0]]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("level,dtype", [("O2", torch.float32), ("O3", torch.float16)])
def test_plain_fp32_optimizer_state_loads_into_an_initialized_optimizer(level, dtype):
    torch.manual_seed(0)
    plain = Net()
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-2, eps=1e-3)
    nn.functional.mse_loss(plain(worker.batch(0)[0]), worker.batch(0)[1]).backward()
    popt.step()
    model, opt = worker.build(level)
    opt.load_state_dict(popt.state_dict())
    for p in ampkit.master_params(opt):
        assert opt.state[p]["exp_avg"].dtype == (torch.float32 if p.dtype == torch.float32 else dtype)
    fc1 = next(iter(ampkit.master_params(opt)))
    assert torch.equal(opt.state[fc1]["exp_avg"], popt.state[plain.fc1.weight]["exp_avg"].to(opt.state[fc1]["exp_avg"].dtype))


def test_apex_format_amp_state_dict_loads():
    # What Apex's amp.state_dict() returns (an OrderedDict of plain Python numbers).
    apex = collections.OrderedDict([("loss_scaler0", {"loss_scale": 1024.0, "unskipped": 17}),
                                    ("loss_scaler1", {"loss_scale": 32768.0, "unskipped": 1999})])
    model = Net()
    model, opt = ampkit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", num_losses=2, verbosity=0)
    ampkit.load_state_dict(disk(apex))
    assert ampkit.state_dict() == {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 17},
                                   "loss_scaler1": {"loss_scale": 32768.0, "unskipped": 1999}}
    scalers = current_run("t").scalers
    x, y = worker.batch(0)
    loss = nn.functional.mse_loss(model(x), y)
    with ampkit.scale_loss(loss, opt, loss_id=1) as scaled:
        assert torch.equal(scaled, loss.float() * 32768.0)
        scaled.backward()
    opt.step()
    assert scalers[1].loss_scale() == 65536.0 and scalers[1].unskipped == 0  # its 2000th clean step
    assert scalers[0].loss_scale() == 1024.0 and scalers[0].unskipped == 17
    # A static-scale Apex checkpoint (O3-style) loads into a static level.
    model = Net()
    model, opt = ampkit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O5", verbosity=0)
    ampkit.load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}})
    assert ampkit.state_dict() == {"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}}


@pytest.mark.parametrize("saved,num_losses", [(2, 1), (1, 3), (3, 2)])
def test_wrong_number_of_losses_says_which_and_changes_nothing(saved, num_losses):
    model = Net()
    model, opt = ampkit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1",
                                   num_losses=num_losses, verbosity=0)
    before = ampkit.state_dict()
    state = {f"loss_scaler{i}": {"loss_scale": 8.0, "unskipped": 3} for i in range(saved)}
    with pytest.raises(ValueError) as error:
        ampkit.load_state_dict(state)
    msg = str(error.value)
    assert f"holds {saved} loss scaler(s)" in msg and f"num_losses={num_losses}" in msg
    assert ampkit.state_dict() == before


# --- bit-exact resume ------------------------------------------------------------------------

N, M = 3, 3


def uninterrupted(level):
    model, opt = worker.build(level)
    worker.train(model, opt, 0, N + M)
    assert opt._ampkit.run.scalers[0].skipped_steps == len(worker.OVERFLOW_STEPS)
    return worker.snapshot(model, opt)


def first_part(level):
    model, opt = worker.build(level)
    worker.train(model, opt, 0, N)
    ckpt = worker.checkpoint(model, opt)
    if level in ("O1", "O2"):  # the overflow at step 1 halved the dynamic scale: it must travel
        assert ckpt["amp"]["loss_scaler0"] == {"loss_scale": 128.0, "unskipped": 1}
    return ckpt


@pytest.mark.parametrize("level", LEVELS)
def test_resume_is_bit_exact_in_process(level):
    expected = uninterrupted(level)
    ckpt = disk(first_part(level))
    model, opt = worker.resume(level, ckpt)
    worker.train(model, opt, N, N + M)
    same(worker.snapshot(model, opt), expected)


def test_resume_without_the_optimizer_state_is_caught_by_the_comparison():
    """The comparison above is sharp enough to see a lost optimizer state."""
    expected = uninterrupted("O2")
    ckpt = disk(first_part("O2"))
    model, opt = worker.build("O2", seed=5)
    model.load_state_dict(ckpt["model"])
    ampkit.load_state_dict(ckpt["amp"])
    worker.train(model, opt, N, N + M)
    with pytest.raises(AssertionError):
        same(worker.snapshot(model, opt), expected)


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_resume_is_bit_exact_in_a_new_process(level, tmp_path):
    expected = uninterrupted(level)
    ckpt_path, out_path = tmp_path / "ckpt.pt", tmp_path / "resumed.pt"
    torch.save(first_part(level), ckpt_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, str(WORKER), level, str(ckpt_path), str(out_path), str(N), str(N + M)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed = torch.load(out_path, weights_only=True)
    assert resumed.pop("pid") != os.getpid()
    same(resumed, expected)


def test_one_element_value_for_a_scalar_parameter_loads_like_pytorch_into_the_master():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.gain = nn.Parameter(torch.tensor(1.5))

        def forward(self, x):
            return self.lin(x) * self.gain

    model = Scaled()
    model, opt = ampkit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["gain"] = torch.tensor([2.123456])  # PyTorch accepts shape (1,) for a 0-dim parameter
    model.load_state_dict(sd)
    assert torch.equal(opt._ampkit.masters[model.gain], torch.tensor(2.123456))
    assert model.gain.dtype == torch.float16 and torch.equal(model.gain, torch.tensor(2.123456).half())
