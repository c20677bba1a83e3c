"""Sharded checkpoints in the layout of earlier versions, whose O7/O8 rounder saved each
rank's generator states as its row of a DTensor: they load (the rows are ignored) and the
run continues from the saved seed and step, bit-exactly, as the run that saved them
(_matrix.py's ``old_layout``, in its 2-rank launch)."""
import pytest

from ._matrix import SAVE_AT

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("level", ["O7", "O8"])
def test_an_old_sharded_checkpoint_with_generator_rows_loads_and_continues_bit_exactly(matrix, level):
    for rank in matrix("2"):
        assert rank[f"old/{level}/rows"][0] == 2  # the checkpoint holds one generator row per rank
        assert rank[f"old/{level}/saved"] == {"seed": 0, "step": SAVE_AT}
        assert rank[f"old/{level}/rounding0"] == rank[f"old/{level}/rounding1"] == rank[f"old/{level}/saved"]
        continued = rank[f"{level}/uninterrupted"][SAVE_AT:]  # the saving run's own continuation
        assert rank[f"old/{level}/losses0"] == rank[f"old/{level}/losses1"] == continued
