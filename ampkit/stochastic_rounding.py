"""Stochastic rounding of float32 to bfloat16 (O7), and reseeding the current run's rounding.

The kernels and the rounder (seed and step of the counter bits) live in
``ampkit._kernels.rounding``; see its docstring for how the rounding stays exactly unbiased.
"""
from ._kernels.rounding import StochasticRounder, round_all_to_bf16_, round_to_bf16_
from ._run import registry

__all__ = ["round_to_bf16_", "round_all_to_bf16_", "StochasticRounder", "manual_seed"]


def manual_seed(seed: int, optimizer=None) -> None:
    """Reseed the stochastic rounding of the run ``optimizer`` belongs to (default: the
    current run, the latest ``initialize`` with optimizers). The default seed is 0."""
    caller = "ampkit.stochastic_rounding.manual_seed()"
    run = registry.run_of(caller, optimizer)
    if run.rounder is None:
        raise RuntimeError(
            f"{caller}: {run.describe()} does not round updates stochastically (use opt_level='O7' "
            f"or update_rounding='stochastic')."
        )
    run.rounder.manual_seed(seed)
