"""Every ``AMPKIT_*`` environment switch in one table: its name, default and meaning.

The readers read through `get` (``python -m ampkit env`` prints the table with the current values).
"""
import os
from typing import NamedTuple

__all__ = ["Switch", "SWITCHES", "get", "on"]


class Switch(NamedTuple):
    name: str
    default: str  # the value when the variable is unset ("" where the default is computed)
    meaning: str


SWITCHES = (
    Switch("AMPKIT_FUSED", "1", "0: no fused AdamW update (every parameter takes the optimizer's own step)"),
    Switch("AMPKIT_NATIVE", "1", "0: no C kernels (the eager references run: the same numbers, slower)"),
    Switch("AMPKIT_COMPILED_UPDATE", "1", "0: no compiled (Triton) O7 update on accelerators (the optimizer's own step)"),
    Switch("AMPKIT_CACHE_DIR", "", "the cache of the C kernels and the hardware probe (unset: ~/.cache/ampkit)"),
    Switch("AMPKIT_PROBE", "1", "0: no speed probe; capabilities() reads the hardware description"),
    Switch("AMPKIT_APEX", "", "ampkit: the apex_compat runner stands in over an installed Apex; apex: it uses that Apex"),
)
_BY_NAME = {s.name: s for s in SWITCHES}


def get(name: str) -> str:
    """The current value of switch ``name``: the environment's, else its default."""
    if name not in _BY_NAME:
        raise ValueError(f"switches.get: name={name!r} is not a switch; expected one of {', '.join(_BY_NAME)}.")
    return os.environ.get(name, _BY_NAME[name].default)


def on(name: str) -> bool:
    """Whether switch ``name`` is not ``"0"``."""
    return get(name) != "0"
