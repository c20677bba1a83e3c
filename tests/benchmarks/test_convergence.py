"""The convergence family (benchmarks/families/convergence.py) on a small subset: properties that hold on
any CPU, never a number measured on one."""
import pytest

import realdata
from ampkit._config.levels import OPT_LEVELS
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


def test_summary_pairs_the_gap_by_seed():
    runs = [{"seed": s, "final": f, "curve": [(10, f)], "step_ms": 1.0, "elementwise_bytes_per_param": 4.0}
            for s, f in ((0, 0.80), (1, 0.90))]
    row = convergence.summarize("mlp", "O8", runs, {0: 0.81, 1: 0.92})
    assert row["gap"] == pytest.approx(-0.015) and row["gap_se"] == pytest.approx(0.005)
    assert row["gap_low"] < row["gap"] < row["gap_high"] and row["spread"] == pytest.approx(0.1)
