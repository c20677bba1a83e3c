"""precision_report's contract: exact counts, the user's objects untouched, validation, the text,
the JSON, the command."""
import copy
import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampkit._cli.report import main_report
from ampkit._precision import precision_report
from ampkit._precision.measure import (
    BF16_FLUSH, BF16_OVERFLOW, FP16_FLUSH, FP16_OVERFLOW, SCALE_EXPONENTS, Stats, _Acc, magnitude_keys,
)

from . import _models as M


EDGES = torch.tensor([v * 2.0 ** -e for e in SCALE_EXPONENTS for v in (FP16_OVERFLOW, FP16_FLUSH)] + [BF16_OVERFLOW, BF16_FLUSH])


def _values(seed, tails):
    """Random magnitudes over 100 binades, every edge at scales 2**-24..2**16 and its float32 neighbours,
    zeros, and (``tails``) bfloat16's edges, subnormals, float32's largest values and NaN/inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4000, generator=g) * torch.pow(2.0, torch.randint(-60, 40, (4000,), generator=g).float())
    edges = EDGES if tails else EDGES[:-2]
    near = [edges, torch.nextafter(edges, torch.tensor(0.0)), torch.nextafter(edges, torch.tensor(math.inf))]
    parts = [x, *near, -near[1], torch.zeros(7)]
    if tails:
        parts.append(torch.tensor([float("nan"), float("inf"), -float("inf"), 3.4e38, -3.3e38, 1e-45, -1e-40, 2e-41]))
    return torch.cat(parts)


@pytest.mark.parametrize("tails", [True, False])
@pytest.mark.parametrize("scale_exp", [16, 8, 0, -10, -24])
def test_counts_match_real_rounding_at_every_scale(scale_exp, tails):
    scale = 2.0 ** scale_exp
    x = _values(scale_exp + 100, tails)
    acc = _Acc()
    assert acc.add(x[: x.numel() // 2]).item() == (~torch.isfinite(x[: x.numel() // 2])).sum().item()
    acc.add(x[x.numel() // 2:])  # two calls: the counts add up
    stats = acc.stats()
    finite = torch.isfinite(x)
    half = (x * scale).half()
    assert stats.numel == x.numel() and stats.nonfinite == (~finite).sum().item() == (3 if tails else 0)
    assert stats.zeros == (x == 0).sum().item() >= 7
    assert stats.amax == x[finite].abs().max().item()
    n, bf = x.numel(), x.bfloat16()
    overflow_bf16, flush_bf16 = (finite & torch.isinf(bf)).sum().item(), (finite & (x != 0) & (bf == 0)).sum().item()
    assert stats.overflow("float16", scale) == (finite & torch.isinf(half)).sum().item() / n
    assert stats.flush("float16", scale) == (finite & (x != 0) & (half == 0)).sum().item() / n
    assert stats.overflow("bfloat16") == overflow_bf16 / n and overflow_bf16 >= (3 if tails else 0)
    assert stats.flush("bfloat16") == flush_bf16 / n and flush_bf16 >= (2 if tails else 0)


def test_magnitude_keys_bins():
    x = torch.tensor([0.0, -0.0, 2.0 ** -149, 1.0, -1.0, 1.5, FP16_OVERFLOW / 2 ** 15, float("nan"), -float("inf")])
    e1 = 127  # the binade of 1.0
    assert magnitude_keys(x).tolist() == [0, 0, 1, 2 * e1, 2 * e1, 2 * e1 + 1, 2 * e1 + 2, 510, 510]
    assert magnitude_keys(x).dtype == torch.int32 and x[3].item() == 1.0  # the input is left as it was


def test_stats_refuse_a_scale_they_did_not_count():
    stats = Stats(1, 0, 1.0, [0] * 511)
    for scale in (3, 2.0 ** 17, 0.0, -1.0):
        with pytest.raises(ValueError, match=r"scale=.*: expected a power of two from 2\*\*-24 to 2\*\*16"):
            stats.overflow("float16", scale)
    with pytest.raises(ValueError, match="1 for bfloat16"):
        stats.flush("bfloat16", 2.0)
    assert stats.overflow("float16", 2.0 ** 16) == 0.0


class Mixed(nn.Module):
    """Dropout (uses the RNG), BatchNorm (buffers), a dict batch and a tuple output."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(M.WIDTH, M.WIDTH)
        self.bn = nn.BatchNorm1d(M.WIDTH)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(M.WIDTH, M.CLASSES)

    def forward(self, x):
        h = self.drop(self.bn(self.fc(x)))
        return self.head(h), h


def mixed_loss(model, batch):
    logits, _ = model(batch["x"])
    return F.cross_entropy(logits, batch["y"])


def dict_batches(n=2):
    return [{"x": x, "y": y} for x, y in M.batches(n)]


def snapshot(model, opt):
    return {"params": {k: v.clone() for k, v in model.named_parameters()},
            "buffers": {k: v.clone() for k, v in model.named_buffers()},
            "grads": {k: v.grad.clone() for k, v in model.named_parameters()},
            "opt": copy.deepcopy(opt.state_dict()), "rng": torch.get_rng_state(), "training": model.training}


def same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def test_the_users_model_optimizer_and_rng_are_left_exactly_as_they_were():
    model = Mixed()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mixed_loss(model, dict_batches(1)[0]).backward()
    opt.step()  # Adam state exists; the grads stay on the parameters
    model.eval()
    before = snapshot(model, opt)
    report = precision_report(model, mixed_loss, iter(dict_batches(3)), opt)
    assert same(snapshot(model, opt), before)
    assert report.measurements.optimizer == "AdamW" and len(report.measurements.losses) == 2
    assert {"fc", "bn", "drop", "head"} <= {r.name for r in report.rows}


def test_default_optimizer_and_one_batch():
    report = precision_report(M.Net(), M.loss_fn, M.batches(1))
    assert report.measurements.optimizer == "SGD(lr=0.001) (no optimizer given)"
    assert report.measurements.applied == [True]
    assert "optimizer SGD(lr=0.001) (no optimizer given)" in str(report)


def test_an_iterator_is_advanced_by_two_batches_only():
    it = iter(M.batches(4))
    precision_report(M.Net(), M.loss_fn, it)
    assert len(list(it)) == 2


@pytest.mark.parametrize("kwargs, error, message", [
    ({"model": "net"}, TypeError, r"precision_report\(model=...\): expected an nn.Module, got str"),
    ({"loss_fn": 3}, TypeError, r"precision_report\(loss_fn=...\): expected a callable loss_fn\(model, batch\), got int"),
    ({"batches": 5}, TypeError, r"precision_report\(batches=...\): expected an iterable of batches, got int"),
    ({"batches": []}, ValueError, r"precision_report\(batches=...\): expected at least one batch"),
    ({"levels": "O2"}, ValueError, r"precision_report\(levels='O2'\): expected None .* from 'O0', 'O1', .*'O7'"),
    ({"levels": ["O2", "O9"]}, ValueError, r"precision_report\(levels=\['O2', 'O9'\]\)"),
    ({"levels": []}, ValueError, r"precision_report\(levels=\[\]\)"),
    ({"optimizer": "adam"}, TypeError, r"precision_report\(optimizer=...\): expected a torch.optim.Optimizer or None, got str"),
    ({"optimizer": torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)}, ValueError, r"holds 2 parameter\(s\) that are not the model's"),
    ({"loss_fn": lambda m, b: 1.0}, TypeError, r"loss_fn\(model, batch\) must return a scalar floating tensor, got float"),
    ({"loss_fn": lambda m, b: m(b[0])}, TypeError, r"got a tensor of shape \(16, 4\)"),
    ({"loss_fn": lambda m, b: m(b[0]).detach().sum()}, ValueError, r"the loss does not require grad"),
])
def test_bad_input_names_the_argument(kwargs, error, message):
    args = {"model": M.Net(), "loss_fn": M.loss_fn, "batches": M.batches(), **kwargs}
    with pytest.raises(error, match=message):
        precision_report(**args)


@pytest.mark.parametrize("level", ["O1", "O2", "O5", "O7", "O8", "remainder"])
def test_a_model_from_initialize_is_refused_in_one_sentence(level):
    import ampkit
    net = M.Net()
    kw = {"opt_level": "O5", "master_weights": "remainder"} if level == "remainder" else {"opt_level": level}
    model, opt = ampkit.initialize(net, torch.optim.Adam(net.parameters(), lr=1e-3), verbosity=0, **kw)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"^precision_report\(model=...\): this model was returned by ampkit.initialize "
                                         r".*; run the report on the fp32 model before initialize.$"):
        precision_report(model, M.loss_fn, M.batches(), opt)
    with pytest.raises(ValueError, match=r"optimizer=...\): this optimizer was returned by ampkit.initialize"):
        precision_report(M.Net(), M.loss_fn, M.batches(), opt)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_meta_model_is_asked_to_be_materialized():
    with torch.device("meta"):
        net = M.Net()
    with pytest.raises(RuntimeError, match=r"precision_report\(model=...\): \w+\.weight is on the meta device; "
                                           r"materialize the model first"):
        precision_report(net, M.loss_fn, M.batches())


def test_to_dict_of_a_nan_loss_is_json_ready():
    net = M.NanNet()
    report = precision_report(net, M.loss_fn, M.batches(), M.adam(net), levels=["O2"])
    assert not all(math.isfinite(x) for x in report.measurements.losses)
    data = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert [x if math.isfinite(x) else None for x in report.measurements.losses] == data["losses"]
    assert None in data["losses"] and data["applied"] == [False, False]


def test_text_table_is_aligned_worst_first_and_limited_to_the_levels():
    net = M.overflow_net()
    report = precision_report(net, M.loss_fn, M.batches(), M.adam(net), levels=["O2", "O5"])
    lines = report.table().splitlines()
    assert lines[0].split()[:2] == ["layer", "type"] and set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].split()[:2] == ["mid", "Linear"]  # the worst row first
    assert all(len(line) <= len(lines[1]) for line in lines)
    assert "act ovf16" in lines[0] and "lost bf16" not in lines[0] and "fp8 err" not in lines[0]
    text = str(report)
    assert list(report.verdicts) == ["O2", "O5"] and "  O5: clean" in text
    assert "  O2: activations overflow fp16 in 1 layer (inf in the forward pass: every step is skipped): mid" in text


def test_to_dict_is_json_ready_and_complete():
    net = M.overflow_net()
    report = precision_report(net, M.loss_fn, M.batches(), M.adam(net))
    data = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert data["levels"] == ["O1", "O2", "O3", "O4", "O5", "O6", "O7"]
    assert [x["name"] for x in data["layers"]] == [r.name for r in report.rows]
    assert data["layers"][0]["name"] == "mid" and "act_overflow_fp16" in data["layers"][0]["findings"]
    assert [v["level"] for v in data["verdicts"]] == data["levels"]
    assert data["verdicts"][1]["status"] == "fails" and data["verdicts"][4]["line"].startswith("O5: ")
    assert data["recommendation"]["level"] == report.recommend().level
    assert data["dynamic_scale"] == {"start": 65536.0, "settled": report.settled_scale}
    fp8 = {x["name"]: x["fp8"] for x in data["layers"] if "fp8" in x}
    assert set(fp8) == {"inp", "mid"} and fp8["mid"]["matmul_error"] == report.measurements.fp8["mid"].matmul_error
    assert set(fp8["mid"]) == {"matmul_error", "input_flush", "weight_flush", "grad_flush"}
    with pytest.raises(ValueError, match=r"recommend\(prefer='fast'\): expected one of 'speed', 'memory'"):
        report.recommend("fast")


def test_plot_without_matplotlib_names_the_install(monkeypatch, tmp_path):
    report = precision_report(M.Net(), M.loss_fn, M.batches(1))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        report.plot(tmp_path / "r.png")
    assert not (tmp_path / "r.png").exists()


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is an optional extra (ampkit[bench])")
    report = precision_report(M.Net(), M.loss_fn, M.batches(1))
    assert report.plot(tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_writes_both_reports_to_the_file_named(capsys, tmp_path):
    target = tmp_path / "rep.html"
    assert main_report(["--html", str(target)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep.html"]
    page = target.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.count("<html") == 1 and page.rstrip().endswith("</html>")
    assert '<h2 id="lm">lm</h2>' in page and '<h2 id="cnn">cnn</h2>' in page
    assert page.index('id="lm"') < page.index('id="cnn"') and page.count("<h3>Verdicts</h3>") == 2
    assert f"wrote {target}" in capsys.readouterr().out


def test_command_prints_the_cnn_report_and_writes_html(capsys, tmp_path):
    assert main_report(["--model", "cnn", "--html", str(tmp_path / "r.html")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("== cnn ==") and "Verdicts:" in out and "Recommended: O" in out
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")
    with pytest.raises(SystemExit):
        main_report(["--model", "rnn"])
