"""O5's fp32 masters against masters kept only as (w, r), simulated side by side
(``benchmarks/remainder_simulation.py``, which benchmarks/frontier_kernels_experiments.py runs too)."""
import pytest
from remainder_simulation import OPTIMIZERS, simulate


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_simulation_matches_o5_bit_for_bit(optimizer):
    """200 steps on dyadic data that meets ties: the (w, r) run's masters, bfloat16 weights and
    losses equal O5's at every step; its side tables list exactly the masters 16 bits cannot
    hold, as many as an independent count over O5's masters finds."""
    out = simulate(optimizer, "remainder")
    assert out["ties"] > 0 and out["lost"] == 0 and out["max_master_ulps"] == 0
    assert out["listed"] == out["plus_ones"] == out["o5_plus_ones"]
    assert out["model_differs"] == out["loss_differs"] == 0


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_simulation_without_tables_loses_exactly_the_values_16_bits_cannot_hold(optimizer):
    """The 16 bits alone lose the d = +32767 above an even w and nothing else (not a tie)."""
    out = simulate(optimizer, "without_table")
    assert out["ties"] > 0 and out["lost"] == out["plus_ones"] and out["listed"] == 0


def test_simulation_losing_ties_loses_every_tie_above_an_even_weight():
    """The saturating encoding loses each d = +32768 instead (dyadic data meets them), and
    its masters leave O5's."""
    out = simulate("sgd", "losing_ties")
    assert out["ties_above_even"] > 0 and out["lost"] == out["ties_above_even"] and out["max_master_ulps"] >= 1
