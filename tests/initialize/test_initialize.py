"""initialize / scale_loss end to end: dtypes per level, training, loss scaling, bad input."""
import copy
import io
import logging

import pytest
import torch
from torch import nn

import ampkit
from ampkit._run.registry import current as current_run

LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
HALF = {"O1": torch.float16, "O2": torch.float16, "O3": torch.float16, "O4": torch.bfloat16, "O5": torch.bfloat16}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.bn_plain = nn.BatchNorm1d(16, affine=False)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn_plain(self.bn(self.fc1(x)))))


def make(device, lr=0.05, opt_cls=torch.optim.SGD, **kw):
    model = Net().to(device)
    opt = opt_cls(model.parameters(), lr=lr, **kw)
    return model, opt


def snapshot(model, opt):
    return (
        type(model),
        {k: v.clone() for k, v in nn.Module.state_dict(model).items()},
        copy.deepcopy(opt.state_dict()),
        [p.dtype for p in model.parameters()],
    )


def assert_same(a, b):
    assert a[0] is b[0] and a[3] == b[3]
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    assert repr(a[2]) == repr(b[2])


def activation_dtype(model, x):
    seen = {}
    h = model.fc1.register_forward_hook(lambda m, i, o: seen.update(fc1=o.dtype))
    out = model(x)
    h.remove()
    return seen["fc1"], out


@pytest.mark.parametrize("level", LEVELS)
def test_dtypes_per_level(level, device):
    model, opt = make(device)
    model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0)
    half = HALF.get(level)
    cast = half if level in ("O2", "O3", "O5") else torch.float32
    bn_dtype = half if level == "O3" else torch.float32
    assert model.fc1.weight.dtype == cast and model.fc2.bias.dtype == cast
    for bn in (model.bn, model.bn_plain):  # affine=False BN is kept fp32 too (Apex's bug fixed)
        assert bn.running_mean.dtype == bn_dtype and bn.running_var.dtype == bn_dtype
        assert bn.num_batches_tracked.dtype == torch.int64
    assert model.bn.weight.dtype == bn_dtype
    act, out = activation_dtype(model, torch.randn(4, 8, device=device))
    assert act == (half or torch.float32)
    assert out.dtype == torch.float32  # outputs come back in float32 at every level


def test_cast_model_outputs_override(device):
    model, opt = make(device)
    model, opt = ampkit.initialize(model, opt, opt_level="O5", cast_model_outputs=torch.bfloat16, verbosity=0)
    assert model(torch.randn(2, 8, device=device)).dtype == torch.bfloat16


def test_keep_batchnorm_fp32_false_casts_batchnorm(device):
    model, opt = make(device)
    model, opt = ampkit.initialize(model, opt, opt_level="O2", keep_batchnorm_fp32=False, verbosity=0)
    assert model.bn.weight.dtype == torch.float16 and model.bn.running_var.dtype == torch.float16


def test_nested_inputs_are_cast(device):
    class Takes(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, batch, scale=None):
            x, (idx, extra) = batch["x"], batch["pair"]
            assert x.dtype == torch.bfloat16 and extra[0].dtype == torch.bfloat16 and scale.dtype == torch.bfloat16
            assert idx.dtype == torch.int64 and batch["name"] == "b"
            return {"y": self.lin(x), "idx": idx}

    model = ampkit.initialize(Takes().to(device), opt_level="O5", verbosity=0)
    batch = {"x": torch.randn(2, 3, device=device), "pair": (torch.arange(2, device=device), [torch.ones(1, device=device)]), "name": "b"}
    out = model(batch, scale=torch.tensor(2.0, device=device))
    assert out["y"].dtype == torch.float32 and out["idx"].dtype == torch.int64
    assert batch["x"].dtype == torch.float32  # caller's data untouched


@pytest.mark.parametrize("level", LEVELS)
def test_training_reduces_loss(level, device):
    torch.manual_seed(1)
    model, opt = make(device, lr=0.1, opt_cls=torch.optim.SGD, momentum=0.9)
    model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0)
    x = torch.randn(64, 8, device=device)
    y = x[:, :4].sum(1, keepdim=True).expand(64, 4).contiguous()
    losses = []
    for _ in range(30):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        with ampkit.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert current_run("test").scalers[0].skipped_steps == 0


def test_scaled_loss_value_and_dtype(device):
    model, opt = make(device)
    model, opt = ampkit.initialize(model, opt, opt_level="O2", verbosity=0)
    loss = model(torch.randn(4, 8, device=device)).sum().half()
    with ampkit.scale_loss(loss, opt) as scaled:
        assert scaled.dtype == torch.float32
        assert scaled.item() == pytest.approx(loss.float().item() * 2.0**16)
        scaled.backward()


def poison(param, steps):
    """Return a hook-installer that makes ``param``'s gradient inf at the given step numbers."""
    state = {"step": 0}

    def hook(grad):
        return torch.full_like(grad, float("inf")) if state["step"] in steps else grad

    param.register_hook(hook)
    return state


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_exact_scale_sequence(level, device, caplog):
    model, opt = make(device)
    model, opt = ampkit.initialize(model, opt, opt_level=level)
    scaler = current_run("test").scalers[0]
    scaler.growth_interval = 3
    counter = poison(model.fc1.weight, {0, 1, 5, 9})
    x = torch.randn(4, 8, device=device)
    seen = []
    with caplog.at_level(logging.INFO, logger="ampkit"):
        for step in range(12):
            counter["step"] = step
            opt.zero_grad()
            with ampkit.scale_loss(model(x).mean(), opt) as s:
                s.backward()
            opt.step()
            seen.append((scaler.loss_scale(), scaler.unskipped))
    s0 = 2.0**16
    expected = [
        (s0 / 2, 0), (s0 / 4, 0), (s0 / 4, 1), (s0 / 4, 2), (s0 / 2, 0), (s0 / 4, 0),
        (s0 / 4, 1), (s0 / 4, 2), (s0 / 2, 0), (s0 / 4, 0), (s0 / 4, 1), (s0 / 4, 2),
    ]
    assert seen == expected
    assert scaler.skipped_steps == 4
    messages = [r.getMessage() for r in caplog.records if "Gradient overflow" in r.getMessage()]
    assert messages[0] == "Gradient overflow. Skipping step, loss scaler 0 reducing loss scale to 32768.0"
    assert len(messages) == 4


def test_max_and_min_loss_scale_clamp(device):
    model, opt = make(device)
    model, opt = ampkit.initialize(model, opt, opt_level="O1", min_loss_scale=2.0**15, max_loss_scale=2.0**15, verbosity=0)
    scaler = current_run("test").scalers[0]
    assert scaler.loss_scale() == 2.0**15
    poison(model.fc1.weight, {0})
    with ampkit.scale_loss(model(torch.randn(2, 8, device=device)).sum(), opt) as s:
        s.backward()
    opt.step()
    assert scaler.loss_scale() == 2.0**15 and scaler.skipped_steps == 1


@pytest.mark.parametrize("level", ["O1", "O2", "O3", "O5"])
def test_skipped_step_leaves_adam_bit_identical(level, device):
    model, opt = make(device, lr=1e-2, opt_cls=torch.optim.Adam, eps=1e-3)  # eps representable in fp16 (O3)
    model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0)
    x = torch.randn(4, 8, device=device)
    counter = poison(model.fc2.weight, {2})
    for step in range(4):
        counter["step"] = step
        opt.zero_grad()
        with ampkit.scale_loss(model(x).pow(2).mean(), opt) as s:
            s.backward()
        before = ([p.clone() for p in model.parameters()], [m.clone() for m in ampkit.master_params(opt)],
                  copy.deepcopy(opt.state_dict()["state"]))
        opt.step()
        if step == 2:
            assert all(torch.equal(a, b) for a, b in zip(before[0], model.parameters()))
            assert all(torch.equal(a, b) for a, b in zip(before[1], ampkit.master_params(opt)))
            after = opt.state_dict()["state"]
            for k, st in before[2].items():
                for name, value in st.items():
                    assert torch.equal(value, after[k][name]), (k, name)
        else:
            assert not torch.equal(before[0][0], model.fc1.weight)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert opt.state_dict()["state"][0]["step"].item() == 3


def test_delay_unscale_keeps_gradients_scaled(device):
    model, opt = make(device)
    model, opt = ampkit.initialize(model, opt, opt_level="O1", verbosity=0)
    x = torch.randn(4, 8, device=device)
    with ampkit.scale_loss(model(x).mean(), opt, delay_unscale=True) as s:
        s.backward()
    scaled = model.fc1.weight.grad.clone()
    opt.zero_grad()
    with ampkit.scale_loss(model(x).mean(), opt) as s:
        s.backward()
    torch.testing.assert_close(scaled / 2.0**16, model.fc1.weight.grad)


def test_enabled_false_is_a_no_op(device):
    model, opt = make(device)
    before = snapshot(model, opt)
    m2, o2 = ampkit.initialize(model, opt, enabled=False, opt_level="O2")
    assert m2 is model and o2 is opt
    assert_same(before, snapshot(model, opt))
    loss = model(torch.randn(2, 8, device=device)).sum()
    with ampkit.scale_loss(loss, opt) as scaled:
        assert scaled is loss


def test_returns_the_structure_it_was_given(device):
    a, b = Net().to(device), Net().to(device)
    oa = torch.optim.SGD(a.parameters(), lr=0.1)
    ob = torch.optim.Adam(b.parameters())
    models, opts = ampkit.initialize([a, b], [oa, ob], opt_level="O1", verbosity=0)
    assert models == [a, b] and opts == [oa, ob]
    assert type(oa) is torch.optim.SGD and type(ob) is torch.optim.Adam  # class kept
    single = ampkit.initialize(Net().to(device), opt_level="O4", verbosity=0)
    assert isinstance(single, Net)


def test_lr_scheduler_keeps_working(device):
    model, opt = make(device, lr=1.0)
    model, opt = ampkit.initialize(model, opt, opt_level="O2", verbosity=0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        with ampkit.scale_loss(model(torch.randn(2, 8, device=device)).sum(), opt) as s:
            s.backward()
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.25


def test_model_survives_deepcopy_pickle_and_compile(device):
    model, opt = make(device)
    model, opt = ampkit.initialize(model, opt, opt_level="O4", verbosity=0)
    model.eval()
    x = torch.randn(3, 8, device=device)
    ref = model(x)
    clone = copy.deepcopy(model)
    torch.testing.assert_close(clone(x), ref)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.testing.assert_close(loaded(x), ref)
    compiled = torch.compile(model, backend="eager")
    out = compiled(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref)


def test_autocast_and_disable_casts(device):
    model, opt = make(device)
    model, opt = ampkit.initialize(model, opt, opt_level="O4", verbosity=0)
    a = torch.randn(4, 4, device=device)
    with ampkit.autocast():
        assert (a @ a).dtype == torch.bfloat16
        with ampkit.disable_casts():
            assert (a @ a).dtype == torch.float32
    assert (a @ a).dtype == torch.float32


def test_disable_casts_is_a_no_op_without_autocast(device):
    model, opt = make(device)
    model, opt = ampkit.initialize(model, opt, opt_level="O2", verbosity=0)
    with ampkit.disable_casts():
        out = model(torch.randn(2, 8, device=device))
    assert out.dtype == torch.float32
    with ampkit.autocast():  # no autocasting at O2: a no-op, not an error
        assert (torch.ones(2, 2, device=device) @ torch.ones(2, 2, device=device)).dtype == torch.float32


def test_verbosity_one_line_two_full_zero_silent(device, caplog):
    with caplog.at_level(logging.INFO, logger="ampkit"):
        model, opt = make(device)
        with pytest.warns(ampkit.NoEffectWarning, match="keep_batchnorm_fp32=True has no effect at O1"):
            ampkit.initialize(model, opt, opt_level="O1", keep_batchnorm_fp32=True, loss_scale=128)
    assert [r.getMessage() for r in caplog.records if not r.getMessage().startswith("float16 on cpu")] == [
        "ampkit O1: model dtype unchanged, autocast to float16, no master weights, static loss scale 128.0"
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ampkit"):
        model, opt = make(device)
        ampkit.initialize(model, opt, opt_level="O5", keep_batchnorm_fp32=True, loss_scale=128, verbosity=2)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert text.count("Selected optimization level O5") == 1
    assert "Overrides applied: keep_batchnorm_fp32=True, loss_scale=128.0" in text
    assert "loss_scale              : 128.0" in text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ampkit"):
        model, opt = make(device)
        ampkit.initialize(model, opt, opt_level="O1", verbosity=0)
    assert caplog.records == []


def test_banner_only_on_rank_zero(monkeypatch, caplog):
    import ampkit._initialize.report

    monkeypatch.setattr(ampkit._initialize.report, "is_main_process", lambda: False)
    with caplog.at_level(logging.INFO, logger="ampkit"):
        model, opt = make("cpu")
        ampkit.initialize(model, opt, opt_level="O5", verbosity=2)
    assert caplog.records == []


def test_library_leaves_logging_configuration_to_the_application():
    import ampkit._common.logs

    logger = logging.getLogger("ampkit")
    model, opt = make("cpu")
    ampkit.initialize(model, opt, opt_level="O5")
    assert logger.level == logging.NOTSET
    assert [type(h).__name__ for h in logger.handlers] == ["_LastResortIfUnconfigured"]
    assert isinstance(logger.handlers[0], logging.NullHandler)
    assert ampkit._common.logs.is_main_process()


def test_unconfigured_warnings_reach_stderr_and_configured_ones_do_not_double():
    """A script that configured nothing: INFO is dropped, warnings go to stderr once; with
    basicConfig, the application's handler alone prints, at the application's level."""
    script = (
        "import logging, sys, torch, ampkit\n"
        "log = logging.getLogger('ampkit')\n"
        "if sys.argv[1] == 'basic':\n"
        "    logging.basicConfig(level=logging.WARNING, format='APP %(message)s')\n"
        "elif sys.argv[1] == 'console':\n"
        "    ampkit.enable_console_logging()\n"
        "model = torch.nn.Linear(2, 2)\n"
        "ampkit.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level='O5')\n"
        "log.warning('WARN-LINE')\n"
    )
    import subprocess
    import sys

    def run(mode):
        proc = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr

    plain = run("none")
    assert plain.count("WARN-LINE") == 1 and "ampkit O5" not in plain
    basic = run("basic")
    assert basic.count("WARN-LINE") == 1 and "APP WARN-LINE" in basic and "ampkit O5" not in basic
    console = run("console")
    assert console.count("WARN-LINE") == 1 and console.count("ampkit O5: model bfloat16") == 1


def test_fp16_on_cpu_is_honoured_and_reported():
    model, opt = make("cpu")
    model, opt = ampkit.initialize(model, opt, opt_level="O2", verbosity=0)
    assert model.fc1.weight.dtype == torch.float16


def test_state_dict_round_trip_in_apex_format(device):
    model, opt = make(device)
    model, opt = ampkit.initialize(model, opt, opt_level="O2", num_losses=2, verbosity=0)
    sd = ampkit.state_dict()
    assert sd == {"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 0}, "loss_scaler1": {"loss_scale": 65536.0, "unskipped": 0}}
    ampkit.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 7}, "loss_scaler1": {"loss_scale": 2.0, "unskipped": 0}})
    assert ampkit.state_dict()["loss_scaler0"] == {"loss_scale": 8.0, "unskipped": 7}
    with pytest.raises(ValueError, match="holds 1 loss scaler.*num_losses=2"):
        ampkit.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 7}})
    assert ampkit.state_dict()["loss_scaler1"]["loss_scale"] == 2.0  # nothing half-loaded


# --- bad input: a clear error, nothing modified ---------------------------------------

BAD_INIT = [
    (dict(opt_level="01"), ValueError, r"did you mean 'O1' \(letter O\)"),
    (dict(opt_level="O9"), ValueError, r"opt_level='O9'.*Accepted values are 'O0'"),
    (dict(opt_level=None), ValueError, r"opt_level=None.*required"),
    (dict(opt_level="O2", keep_batchnorm_fp32="maybe"), TypeError, r"keep_batchnorm_fp32='maybe'"),
    (dict(opt_level="O2", loss_scale=-1), ValueError, r"loss_scale=-1"),
    (dict(opt_level="O2", loss_scale=0), ValueError, r"loss_scale=0"),
    (dict(opt_level="O2", loss_scale=float("nan")), ValueError, r"loss_scale=nan"),
    (dict(opt_level="O2", loss_scale="fast"), ValueError, r"loss_scale='fast'"),
    (dict(opt_level="O2", cast_model_type=torch.int64), TypeError, r"cast_model_type=torch.int64"),
    (dict(opt_level="O2", half_dtype=torch.int8), TypeError, r"half_dtype=torch.int8"),
    (dict(opt_level="O2", num_losses=0), ValueError, r"num_losses=0"),
    (dict(opt_level="O2", verbosity=5), ValueError, r"verbosity=5"),
    (dict(opt_level="O2", min_loss_scale=-2), ValueError, r"min_loss_scale=-2"),
    (dict(opt_level="O2", cast_model_outputs=torch.int32), TypeError, r"cast_model_outputs"),
    (dict(opt_level="O2", ddp=True), RuntimeError, r"ddp=True.*process group is not initialized"),
]


@pytest.mark.parametrize("kwargs,exc,msg", BAD_INIT, ids=[str(k) for k, _, _ in BAD_INIT])
def test_bad_initialize_arguments_change_nothing(kwargs, exc, msg, device):
    model, opt = make(device, opt_cls=torch.optim.Adam)
    model(torch.randn(2, 8, device=device)).sum().backward()
    opt.step()  # give Adam some state
    before = snapshot(model, opt)
    with pytest.raises(exc, match=msg):
        ampkit.initialize(model, opt, **kwargs)
    assert_same(before, snapshot(model, opt))
    assert not hasattr(model, "_ampkit") and not hasattr(opt, "_ampkit")
    ampkit.initialize(model, opt, opt_level="O2", verbosity=0)  # still usable
    assert model.fc1.weight.dtype == torch.float16


def test_wrapped_model_is_refused(device):
    model, opt = make(device)
    wrapped = nn.DataParallel(model)
    with pytest.raises(RuntimeError, match="already wrapped in torch.nn.parallel.data_parallel.DataParallel.*initialize on the bare model first"):
        ampkit.initialize(wrapped, opt, opt_level="O1")


def test_second_initialize_is_refused(device):
    model, opt = make(device)
    ampkit.initialize(model, opt, opt_level="O1", verbosity=0)
    with pytest.raises(RuntimeError, match="already passed through ampkit.initialize"):
        ampkit.initialize(model, opt, opt_level="O1")
    other = Net().to(device)
    with pytest.raises(RuntimeError, match="optimizer was already passed through ampkit.initialize"):
        ampkit.initialize(other, opt, opt_level="O1")
    assert not hasattr(other, "_ampkit")


def test_foreign_optimizer_params_are_refused(device):
    model, _ = make(device)
    stranger = nn.Linear(2, 2).to(device)
    opt = torch.optim.SGD(list(model.parameters()) + list(stranger.parameters()), lr=0.1)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match="2 parameter\\(s\\) that belong to none of the models"):
        ampkit.initialize(model, opt, opt_level="O2")
    assert_same(before, snapshot(model, opt))


def test_meta_model_is_refused():
    with torch.device("meta"):
        model = Net()
    with pytest.raises(RuntimeError, match="meta device; materialize the model first"):
        ampkit.initialize(model, opt_level="O1")


def test_scale_loss_before_initialize_and_bad_loss_id(device):
    model, opt = make(device)
    loss = model(torch.randn(2, 8, device=device)).sum()
    with pytest.raises(RuntimeError, match="did not go through ampkit.initialize"):
        with ampkit.scale_loss(loss, opt):
            pass
    model, opt = ampkit.initialize(model, opt, opt_level="O1", num_losses=2, verbosity=0)
    for bad in (2, -1, "0"):
        with pytest.raises(ValueError, match=r"loss_id=.*expected an integer in \[0, 1\].*num_losses=2"):
            with ampkit.scale_loss(model(torch.randn(2, 8, device=device)).sum(), opt, loss_id=bad):
                pass
    with pytest.raises(ValueError, match=r"expected a scalar .*got \(2, 4\)"):
        with ampkit.scale_loss(model(torch.randn(2, 8, device=device)), opt):
            pass


def test_warns_when_adam_eps_vanishes_in_half_without_masters(caplog):
    model = Net()
    opt = torch.optim.Adam(model.parameters(), eps=1e-8)
    with caplog.at_level(logging.INFO, logger="ampkit"):
        ampkit.initialize(model, opt, opt_level="O3")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Adam eps=1e-08 rounds to 0 in torch.float16" in warnings[0]
