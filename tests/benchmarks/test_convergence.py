"""The convergence family (benchmarks/families/convergence.py) on a small subset: properties that hold on
any CPU, never a number measured on one."""
import pytest
import torch

import ampkit
import plot
import realdata
from ampkit._config.levels import OPT_LEVELS
from common import FULL
from families import convergence

# O6 needs its own extra; O3 (fp16 weights and AdamW state, no masters) does not train with AdamW's eps of 1e-8,
# which rounds to 0 in fp16 (the convergence page shows it at chance).
LEVELS = [lvl for lvl in OPT_LEVELS if lvl not in ("O3", "O6")] + ["O5 remainder", "O7 bf16 state"]
CFG = dict(steps=100, lr=2e-3, seeds=2, curve_points=1)
CHANCE = 0.1  # ten balanced classes


@pytest.fixture(scope="module")
def images():
    try:
        return convergence.Images(realdata.FASHION_MNIST, batch=32, limit=2000)
    except realdata.MissingData as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def finals(images):
    """Each level's test accuracy per seed after the same steps on the same batches."""
    return {name: [run["final"] for run in convergence.train_variant(images, convergence.mlp, name, CFG, lambda *a: None)]
            for name in LEVELS}


@pytest.mark.slow
@pytest.mark.parametrize("name", LEVELS)
def test_every_level_learns_the_mlp_well_past_chance_and_near_o0(finals, name):
    runs, base = finals[name], finals["O0"]
    assert all(isinstance(r, float) for r in runs), runs  # a string: the variant failed, and why
    assert min(runs) > 5 * CHANCE
    gap = sum(b - r for r, b in zip(runs, base)) / len(runs)
    assert gap < 0.05, f"{name}: {gap:.3f} behind O0 over the same seeds"


def test_schedule_warms_up_then_decays_to_zero():
    lrs = [convergence.schedule(1.0, i, 100) for i in range(100)]
    assert lrs[0] == pytest.approx(0.2) and max(lrs) == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(1 / 95) and lrs == sorted(lrs[:5]) + sorted(lrs[5:], reverse=True)


def runs_of(*finals):
    return [{"seed": s, "final": f, "curve": [(10, f)], "step_ms": 1.0, "elementwise_bytes_per_param": 4.0, "epochs": 2.0}
            for s, f in enumerate(finals)]


def test_summary_pairs_the_gap_by_seed():
    row = convergence.summarize("mlp", "O8", runs_of(0.80, 0.90), {0: 0.81, 1: 0.92})
    assert row["gap"] == pytest.approx(-0.015) and row["gap_se"] == pytest.approx(0.005)
    assert row["gap_low"] < row["gap"] < row["gap_high"] and row["spread"] == pytest.approx(0.1)
    assert row["epochs"] == 2.0 and "note" not in row


def test_o3_row_says_why_it_needs_a_larger_eps():
    assert torch.tensor(1e-8, dtype=torch.float16).item() == 0  # the note's premise: AdamW's eps is 0 in fp16
    assert torch.tensor(1e-4, dtype=torch.float16).item() > 0
    row = convergence.summarize("mlp", "O3", runs_of(0.1, 0.1), {0: 0.85, 1: 0.86})
    _, cells = plot.convergence_table([row], "mlp")
    assert "eps" in cells[0][-1] and cells[0][-1] == convergence.NOTES["O3"]


def test_a_skipped_row_shows_why_in_the_note_column():
    _, cells = plot.convergence_table([{"task": "cnn", "variant": "O1", "skipped": "float16 passes take 5x"}], "cnn")
    assert cells[0][0] == "O1" and cells[0][-1] == "float16 passes take 5x"


@pytest.mark.parametrize("level", ["O0", "O5", "O7"])
def test_the_cnn_stays_channels_last_through_initialize(level):
    """The full run's CNN budget assumes channels-last convolutions at every level (the bf16 cast keeps the layout)."""
    model = convergence.cnn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = ampkit.initialize(model, opt, opt_level=level, verbosity=0)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 2
    assert all(m.weight.is_contiguous(memory_format=torch.channels_last) for m in convs if m.weight.shape[1] > 1)
    out = model(torch.randn(4, 1, 28, 28))
    assert out.shape == (4, 10) and torch.isfinite(out.float()).all()


def test_the_full_run_trains_several_epochs_over_at_least_three_seeds():
    """The issue's terms: >= 3 seeds; the image tasks long enough for the round-to-nearest controls to fall behind."""
    conv = FULL["convergence"]
    assert all(task.get("seeds", conv["seeds"]) >= 3 for task in conv["tasks"].values())
    for name in ("cnn", "mlp"):
        task = conv["tasks"][name]
        assert task["steps"] * task["batch"] >= 3 * 60_000, name  # Fashion-MNIST's training set, 3 times over
