"""Models whose precision failures are known: the report names exactly the broken layers, and
training them at each level does what the report says."""
import copy
import dataclasses
import importlib.util
import itertools

import pytest
import torch

import ampkit
from ampkit._model import float8
from ampkit._hardware import FP8_EMULATED, MEMORY, SLOWER, SPEED, Capabilities
from ampkit._precision import precision_report

from . import _models as M

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
GPU = Capabilities("cuda:0", "test GPU", "sm_90", True, True, "tensor cores", "tensor cores",
                   {lvl: SPEED for lvl in ampkit.OPT_LEVELS})
FP16_ONLY = Capabilities("cuda:0", "test GPU", "sm_75", False, True, "", "tensor cores",
                         {**{lvl: SPEED for lvl in ampkit.OPT_LEVELS}, **{lvl: MEMORY for lvl in ("O4", "O5", "O7", "O8")},
                          "O6": FP8_EMULATED})
CPU = Capabilities("cpu", "test CPU", "AVX2", False, False, "", "", {lvl: SLOWER for lvl in ampkit.OPT_LEVELS})


def named(report, level=None, metric=None, severities=("fails", "warns", "note")):
    """Layers named by the report's findings (at ``level``, for ``metric``)."""
    return {n for v in report.verdicts.values() if level in (None, v.level) for f in v.findings
            if metric in (None, f.metric) and f.severity in severities for n in f.layers}


def owners(names):
    return {n.rpartition(".")[0] if n.endswith((".weight", ".bias")) else n for n in names}


def train(net, level, steps=3, slow=(), dead=False, **overrides):
    """Train a copy of ``net`` at ``level``: (model, skipped steps)."""
    net = copy.deepcopy(net)
    model, opt = ampkit.initialize(net, M.adam(net, slow=slow), opt_level=level, verbosity=0, **overrides)
    for batch in itertools.islice(itertools.cycle(M.batches(dead=dead)), steps):
        opt.zero_grad()
        with ampkit.scale_loss(M.loss_fn(model, batch), opt) as scaled:
            scaled.backward()
        opt.step()
    return model, ampkit.loss_scalers(opt)[0].skipped_steps


def test_fp16_overflow_is_named_and_skips_every_fp16_step():
    net = M.overflow_net()
    report = precision_report(net, M.loss_fn, M.batches(), M.adam(net))
    assert owners(named(report)) == {"mid"}
    for level in ("O1", "O2", "O3"):
        assert report.verdicts[level].status == "fails"
        assert named(report, level, "act_overflow_fp16") == {"mid"}
    for level in ("O4", "O5", "O6", "O7"):
        assert named(report, level, severities=("fails", "warns")) == set()
    assert "O2: activations overflow fp16 in 1 layer" in str(report)
    assert train(net, "O2")[1] == 3 and train(net, "O1")[1] == 3  # every fp16 step skipped
    assert train(net, "O5")[1] == 0


def test_keep_fp32_recommendation_trains_at_o1():
    net = M.overflow_net()
    report = precision_report(net, M.loss_fn, M.batches(), M.adam(net))
    rec = report.recommend(capabilities=FP16_ONLY)
    assert (rec.level, rec.keep_fp32, rec.fp8_exclude) == ("O1", ("mid",), ())
    assert "O2 is ruled out: activations overflow fp16 in 1 layer" in rec.reason
    assert report.recommend(capabilities=GPU).level == "O6"
    narrow = precision_report(net, M.loss_fn, M.batches(), M.adam(net), levels=["O2", "O5"])
    rec = narrow.recommend(capabilities=FP16_ONLY)
    assert rec.level == "O0" and rec.reason.startswith("No half-precision level that this report judged suits")
    assert "O1 was not judged (pass it in levels). O2 is ruled out: activations overflow fp16" in rec.reason
    net.mid_fp32 = True  # what keep_fp32 says: mid's forward under ampkit.disable_casts()
    assert train(net, "O1")[1] == 0


def test_lost_bf16_updates_are_named_and_plain_bf16_leaves_the_weights_unchanged():
    net = M.stalled_net()
    report = precision_report(net, M.loss_fn, M.batches(), M.adam(net, slow=("mid.weight",)))
    assert named(report) == {"mid.weight"}
    assert named(report, "O7", "lost_bf16", ("note",)) == {"mid.weight"}
    assert named(report, "O3", "lost_fp16", ("warns",)) == {"mid.weight"}
    assert report.verdicts["O5"].status == "clean" and report.verdicts["O7"].status == "clean"
    row = next(r for r in report.rows if r.name == "mid.weight")
    assert row.values["lost_bf16"] == 1.0
    start = net.state_dict()
    plain, skipped = train(net, "O3", slow=("mid.weight",), half_dtype=torch.bfloat16)  # bf16 weights, no masters
    after = plain.state_dict()
    assert skipped == 0 and after["mid.weight"].dtype == torch.float32
    assert torch.equal(after["mid.weight"], start["mid.weight"].bfloat16().float())  # not one element moved
    assert not torch.equal(after["inp.weight"], start["inp.weight"].bfloat16().float())  # the rest trains
    nearest, _ = train(net, "O7", slow=("mid.weight",), update_rounding="nearest")
    assert torch.equal(nearest.state_dict()["mid.weight"], start["mid.weight"].bfloat16().float())
    fp32, _ = train(net, "O0", slow=("mid.weight",))
    masters, _ = train(net, "O5", slow=("mid.weight",))
    for trained in (fp32, masters):  # fp32 weights and O5's fp32 masters keep the updates (all but dead units')
        assert (trained.state_dict()["mid.weight"] != start["mid.weight"]).float().mean() > 0.95


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed (pip install -e '.[fp8]')")
def test_fp8_outlier_is_named_and_matches_torchao():
    net = M.OutlierNet()
    data = M.batches(dead=True)
    report = precision_report(net, M.loss_fn, data, M.adam(net))
    assert named(report) == {"first"} == named(report, "O6", "fp8_error")
    errors = {r.name: r.values["fp8_error"] for r in report.rows if r.values.get("fp8_error") is not None}
    assert set(errors) == {"first", "second"}  # the head is not converted
    fp8 = copy.deepcopy(net)
    float8.convert_(fp8, "emulate")
    x = data[0][0]
    ref = net.first(x)
    torchao_error = ((fp8.first(x) - ref).norm() / ref.norm()).item()
    assert torchao_error > 0.125 and abs(torchao_error - errors["first"]) < 0.05
    assert errors["second"] < 0.06
    rec = report.recommend(capabilities=GPU)
    assert (rec.level, rec.fp8_exclude, rec.keep_fp32) == ("O6", ("first",), ())
    assert report.recommend(capabilities=FP16_ONLY).level == "O2"


def test_nan_layer_is_named_alone_and_every_step_is_skipped():
    net = M.NanNet()
    report = precision_report(net, M.loss_fn, M.batches(), M.adam(net), levels=["O0", "O2", "O5"])
    assert named(report) == {"bad"}
    for level in ("O0", "O2", "O5"):
        assert report.verdicts[level].status == "fails" and named(report, level, "nonfinite") == {"bad"}
    assert report.measurements.applied == [False, False]
    assert train(net, "O5")[1] == 3 and train(net, "O0")[1] == 3
    rec = report.recommend(capabilities=GPU)
    assert rec.level == "O5" and "Fix first: NaN/inf produced in fp32 already by 1 layer" in rec.reason


def test_clean_model_recommendations_follow_the_machine():
    net = M.Net()
    report = precision_report(net, M.loss_fn, M.batches(), M.adam(net))
    assert named(report, severities=("fails", "warns")) == set()
    assert report.recommend(capabilities=GPU).level == "O6"
    assert report.recommend(capabilities=FP16_ONLY).level == "O2"
    assert report.recommend(capabilities=CPU).level == "O0"
    assert report.recommend("memory", capabilities=CPU).level == "O7"
    assert "O7 runs slower than O0 here" in report.recommend("memory", capabilities=CPU).reason
    # flags say AVX512-BF16, the probe measured bf16 matmuls at 1.9x fp32's time (issue 39's Xeon): O0 for speed
    xeon = dataclasses.replace(CPU, native_bf16=True, bf16_via="AVX512-BF16", source="measured at 2 threads",
                               measured={"bfloat16": {"matmul": 1.9, "conv": 0.9}, "float16": {"matmul": 1.0, "conv": 1.0}})
    rec = report.recommend(capabilities=xeon)
    assert rec.level == "O0" and "No half dtype is faster than float32" in rec.reason and "matmul 1.90x" in rec.reason
    fp16_fast = dataclasses.replace(CPU, levels={**CPU.levels, "O1": SPEED, "O2": SPEED, "O3": SPEED})
    assert report.recommend(capabilities=fp16_fast).level == "O2"
    no_fp8 = precision_report(net, M.loss_fn, M.batches(), M.adam(net), levels=["O1", "O5"])
    assert no_fp8.recommend(capabilities=GPU).level == "O5"
    assert no_fp8.recommend("memory", capabilities=GPU).level == "O5"
