"""The opt levels as data, and the one place that validates overrides.

Each level is a row of defaults; ``resolve`` applies a user's keyword overrides to a
row after checking every value, and returns the final `Properties` together
with notes on overrides that have no effect at that level.
"""
import dataclasses
import enum
import math
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from .._common import text_table

HALF_DTYPE = "half_dtype"  # table marker: "cast the model to the level's half dtype"
HALF_DTYPES = (torch.float16, torch.bfloat16)
REMAINDER = "remainder"  # master_weights: the fp32 master as bf16 weight + int16 remainder (_kernels/remainder.py)
STATE_8BIT = "8bit"  # optimizer_state_dtype: 8-bit codes with per-block scales (_update/state_8bit.py)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
FLT_TINY, FLT_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
FLOAT32_RANGE = f"that float32 holds as a normal number ({FLT_TINY:.4g} to {FLT_MAX:.4g})"


class UpdateKind(enum.Enum):
    """How the optimizer's update reaches the weights: settled by ``resolve``, read as ``Properties.update``."""

    OPTIMIZER = "optimizer"  # torch's own step on the model's parameters (fp32, or half without masters)
    MASTERS = "masters"  # fp32 master copies of the half parameters (O2, O5, O6)
    REMAINDER = "remainder"  # fp32 masters held as the bf16 weight plus an int16 remainder
    ROUNDED = "rounded"  # half weights, each update computed in fp32 and rounded back (O7)
    EIGHT_BIT = "eight_bit"  # ROUNDED with 8-bit optimizer state (O8)


@dataclasses.dataclass(frozen=True)
class Properties:
    """What one opt level (after overrides) asks ``initialize`` to do.

    Attributes:
        opt_level: the level's name (``"O0"``...).
        cast_model_type: dtype the model is cast to, or ``None`` for no cast.
        patch_torch_functions: run the forward under ``torch.autocast`` in ``half_dtype``.
        keep_batchnorm_fp32: keep BatchNorm in fp32 when the model is cast to half.
        master_weights: the optimizer steps on fp32 master copies of half parameters; ``"remainder"``:
            the same fp32 masters, held as the bf16 weight plus a 16-bit remainder (no fp32 copy).
        loss_scale: ``"dynamic"`` or a static positive scale.
        half_dtype: the level's half dtype (float16 or bfloat16), ``None`` at O0.
        low_precision_layernorm: LayerNorm runs in the half dtype under autocast.
        update_rounding: ``None`` (the optimizer updates what it holds), or ``"stochastic"`` /
            ``"nearest"``: half weights without masters, each update computed in fp32 and
            rounded back that way (O7).
        optimizer_state_dtype: dtype the optimizer's elementwise state is kept in between
            steps at ``update_rounding`` levels; ``None`` keeps the optimizer's own; ``"8bit"``:
            8-bit codes with a float32 scale per block of 256, rounded stochastically (O8).
        fp8: ``True`` (fp8 matmuls, emulated where the device has none), ``"emulate"``, or
            ``False``: torchao ``Float8Linear`` in eligible Linear layers (O6).
    """

    opt_level: str
    cast_model_type: Optional[Any]  # torch dtype, HALF_DTYPE (table only) or None
    patch_torch_functions: bool
    keep_batchnorm_fp32: Optional[bool]
    master_weights: Union[None, bool, str]
    loss_scale: Union[float, str]
    half_dtype: Optional[torch.dtype]
    low_precision_layernorm: bool = False
    update_rounding: Optional[str] = None
    optimizer_state_dtype: Union[None, torch.dtype, str] = None
    fp8: Union[bool, str] = False

    def rows(self) -> List[Tuple[str, Any]]:
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]

    # Derived from the fields, not fields themselves: no option, table column, repr or
    # equality term, and nothing new in a pickle.
    @property
    def update(self) -> "UpdateKind":
        """The `UpdateKind` these properties ask for."""
        if self.master_weights == REMAINDER:
            return UpdateKind.REMAINDER
        if self.master_weights is True and self._half_model():
            return UpdateKind.MASTERS
        if self.update_rounding is not None:
            return UpdateKind.EIGHT_BIT if self.optimizer_state_dtype == STATE_8BIT else UpdateKind.ROUNDED
        return UpdateKind.OPTIMIZER

    @property
    def has_masters(self) -> bool:
        """Whether the optimizer steps on fp32 masters of the half weights (as copies or remainders)."""
        return self.update in (UpdateKind.MASTERS, UpdateKind.REMAINDER)

    @property
    def reduces_in_fp32(self) -> bool:
        """Whether DDP reduces the gradients in fp32: a half model without masters."""
        return self._half_model() and not self.has_masters

    def _half_model(self) -> bool:
        return self.cast_model_type in HALF_DTYPES or self.cast_model_type == HALF_DTYPE


def _level(name, cast, patch, keep_bn, master, scale, half):
    return Properties(name, cast, patch, keep_bn, master, scale, half)


OPT_LEVELS: Dict[str, Properties] = {
    "O0": _level("O0", torch.float32, False, None, False, 1.0, None),
    "O1": _level("O1", None, True, None, None, "dynamic", torch.float16),
    "O2": _level("O2", HALF_DTYPE, False, True, True, "dynamic", torch.float16),
    "O3": _level("O3", HALF_DTYPE, False, False, False, 1.0, torch.float16),
    "O4": _level("O4", None, True, None, None, 1.0, torch.bfloat16),
    "O5": _level("O5", HALF_DTYPE, False, True, True, 1.0, torch.bfloat16),
    "O6": dataclasses.replace(_level("O6", HALF_DTYPE, False, True, True, 1.0, torch.bfloat16), fp8=True),
    "O7": dataclasses.replace(_level("O7", HALF_DTYPE, False, True, False, 1.0, torch.bfloat16), update_rounding="stochastic"),
    "O8": dataclasses.replace(_level("O8", HALF_DTYPE, False, True, False, 1.0, torch.bfloat16), update_rounding="stochastic",
                              optimizer_state_dtype=STATE_8BIT),
}
"""Each opt level's `Properties`, "O0" to "O8": the table `initialize` starts from; its keyword
arguments override single properties (docs: "Choosing a level")."""

BRIEF = {
    "O0": "Pure FP32 training.",
    "O1": "Autocast: FP32 weights, float16 ops where safe (torch.autocast), dynamic loss scaling.",
    "O2": "FP16 model with FP32 batchnorm and FP32 master weights, dynamic loss scaling.",
    "O3": "Pure FP16 training.",
    "O4": "Autocast to bfloat16: FP32 weights, bfloat16 ops where safe, no loss scaling.",
    "O5": "BF16 model with FP32 batchnorm and FP32 master weights, no loss scaling.",
    "O6": "O5 plus FP8 matmuls (torchao Float8Linear) in eligible Linear layers; needs ampkit[fp8].",
    "O7": "BF16 model without master weights: each update computed in FP32, stochastically rounded back.",
    "O8": "O7 plus 8-bit optimizer state (per-block scales, stochastically rounded), widened to FP32 for each step.",
}

OVERRIDES = tuple(f.name for f in dataclasses.fields(Properties) if f.name != "opt_level")


def _accepted_levels() -> str:
    return ", ".join(repr(k) for k in OPT_LEVELS)


def check_opt_level(opt_level) -> str:
    """Return ``opt_level`` if it names a level, else raise a ValueError that helps."""
    if isinstance(opt_level, str) and opt_level in OPT_LEVELS:
        return opt_level
    if opt_level is None:
        raise ValueError(
            f"initialize(opt_level=None): an opt_level is required when enabled=True; "
            f"accepted values are {_accepted_levels()}."
        )
    hint = ""
    if isinstance(opt_level, str) and len(opt_level) == 2 and opt_level[0] in "0o":
        letter = "O" + opt_level[1]
        if letter in OPT_LEVELS:
            why = "the digit zero" if opt_level[0] == "0" else "a lower-case o"
            hint = f"; did you mean {letter!r} (letter O)? The prefix is the capital letter O, not {why}"
    raise ValueError(
        f"initialize(opt_level={opt_level!r}): unknown opt level{hint}. Accepted values are "
        f"{_accepted_levels()}."
    )


def _bool(name, value) -> bool:
    if isinstance(value, bool):
        return value
    raise TypeError(f"initialize({name}={value!r}): expected True or False.")


def _master_weights(value):
    if isinstance(value, bool) or value == REMAINDER:
        return value
    raise TypeError(f"initialize(master_weights={value!r}): expected True, False or {REMAINDER!r} (the fp32 "
                    f"master held as the bf16 weight plus a 16-bit remainder).")


def _dtype_name(dtypes) -> str:
    return ", ".join(str(d) for d in dtypes)


def _cast_model_type(value):
    if value is False:
        return None
    if isinstance(value, torch.dtype) and value in FLOAT_DTYPES:
        return value
    raise TypeError(
        f"initialize(cast_model_type={value!r}): expected a floating dtype "
        f"({_dtype_name(FLOAT_DTYPES)}) or False/None for no model cast."
    )


def _keep_batchnorm_fp32(value):
    if value in ("True", "False"):
        return value == "True"
    if isinstance(value, bool):
        return value
    raise TypeError(
        f"initialize(keep_batchnorm_fp32={value!r}): expected True, False, "
        f"the strings 'True'/'False', or None."
    )


def positive_finite(name, value) -> float:
    """``value`` as a float if it is a positive finite number (or numeric string)."""
    if isinstance(value, bool):
        raise TypeError(f"initialize({name}={value!r}): expected a positive number, not a bool.")
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = None
    if number is None or not math.isfinite(number) or number <= 0:
        raise ValueError(f"initialize({name}={value!r}): expected a positive finite number.")
    if not FLT_TINY <= number <= FLT_MAX:  # 1e39 is inf in float32, 1e-39 a subnormal
        raise ValueError(f"initialize({name}={value!r}): expected a positive finite number {FLOAT32_RANGE}.")
    return number


def _loss_scale(value):
    if value == "dynamic":
        return "dynamic"
    try:
        return positive_finite("loss_scale", value)
    except (TypeError, ValueError):
        raise ValueError(
            f"initialize(loss_scale={value!r}): expected \"dynamic\", a positive finite number "
            f"{FLOAT32_RANGE}, or a numeric string such as \"128.0\"."
        ) from None


def _half_dtype(value):
    if isinstance(value, torch.dtype) and value in HALF_DTYPES:
        return value
    raise TypeError(
        f"initialize(half_dtype={value!r}): expected {_dtype_name(HALF_DTYPES)}."
    )


UPDATE_ROUNDINGS = ("nearest", "stochastic")
STATE_DTYPES = (torch.float32, torch.bfloat16)
FP8_MODES = (True, False, "emulate")


def _update_rounding(value):
    if value in UPDATE_ROUNDINGS:
        return value
    raise ValueError(
        f"initialize(update_rounding={value!r}): expected 'stochastic', 'nearest', or False/None "
        f"(the optimizer updates the half weights itself)."
    )


def _optimizer_state_dtype(value):
    if (isinstance(value, torch.dtype) and value in STATE_DTYPES) or (isinstance(value, str) and value == STATE_8BIT):
        return value
    raise TypeError(f"initialize(optimizer_state_dtype={value!r}): expected {_dtype_name(STATE_DTYPES)}, "
                    f"{STATE_8BIT!r} (8-bit codes with per-block scales, O8) or None.")


def _fp8(value):
    if isinstance(value, bool) or value == "emulate":
        return value
    raise ValueError(
        f"initialize(fp8={value!r}): expected True (fp8 matmuls, emulated where the device has none), "
        f"'emulate' (always emulated) or False."
    )


_CHECKS = {
    "cast_model_type": _cast_model_type,
    "patch_torch_functions": lambda v: _bool("patch_torch_functions", v),
    "keep_batchnorm_fp32": _keep_batchnorm_fp32,
    "master_weights": _master_weights,
    "loss_scale": _loss_scale,
    "half_dtype": _half_dtype,
    "low_precision_layernorm": lambda v: _bool("low_precision_layernorm", v),
    "update_rounding": lambda v: None if v is False else _update_rounding(v),
    "optimizer_state_dtype": _optimizer_state_dtype,
    "fp8": _fp8,
}


def resolve(opt_level, **overrides) -> Tuple[Properties, Properties, Dict[str, Any], List[str]]:
    """Validate ``overrides`` against ``opt_level``'s row.

    Returns ``(defaults, final, applied, notes)``: the level's row, the row after
    overrides (``cast_model_type`` resolved to a dtype or None), the overrides that were
    applied, and human-readable notes on overrides that have no effect at this level.
    Raises before anything is returned, so a bad value never leaves partial state.
    """
    defaults = OPT_LEVELS[check_opt_level(opt_level)]
    unknown = set(overrides) - set(OVERRIDES)
    if unknown:
        raise TypeError(f"initialize() got unexpected option(s) {sorted(unknown)}; accepted: {OVERRIDES}.")
    applied = {k: _CHECKS[k](v) for k, v in overrides.items() if v is not None}
    final = dataclasses.replace(defaults, **applied)
    final, notes = _resolve_update(defaults.opt_level, final, applied)
    half = final.half_dtype or torch.float16
    if final.cast_model_type == HALF_DTYPE:
        final = dataclasses.replace(final, cast_model_type=half)
    if final.half_dtype is None and final.patch_torch_functions:
        final = dataclasses.replace(final, half_dtype=half)
    if final.patch_torch_functions and final.cast_model_type in HALF_DTYPES and final.cast_model_type != final.half_dtype:
        raise ValueError(
            f"initialize(cast_model_type={final.cast_model_type}): conflicts with half_dtype={final.half_dtype}, "
            f"the dtype autocast runs in (patch_torch_functions=True at {defaults.opt_level}); pass "
            f"half_dtype={final.cast_model_type}, or cast_model_type={final.half_dtype}."
        )

    casts_to_half = final.cast_model_type in HALF_DTYPES
    if "keep_batchnorm_fp32" in applied and not casts_to_half:
        notes.append(
            f"keep_batchnorm_fp32={applied['keep_batchnorm_fp32']} has no effect at {defaults.opt_level}: "
            f"the model is not cast to a half dtype, so BatchNorm stays float32 anyway."
        )
    if applied.get("master_weights") and not casts_to_half:
        notes.append(
            f"master_weights={applied['master_weights']!r} has no effect at {defaults.opt_level}: the model weights "
            f"stay float32, so they are their own master weights."
        )
        final = dataclasses.replace(final, master_weights=False) if final.master_weights == REMAINDER else final
    if final.master_weights == REMAINDER and final.cast_model_type != torch.bfloat16:
        raise ValueError(
            f"initialize(master_weights='remainder'): the bf16 weight plus a 16-bit remainder holds an fp32 master "
            f"only for a bfloat16 model, but {defaults.opt_level} casts it to {final.cast_model_type}; pass "
            f"half_dtype=torch.bfloat16 (O5, O6), or master_weights=True."
        )
    if "half_dtype" in applied and not (final.patch_torch_functions or casts_to_half):
        notes.append(f"half_dtype={applied['half_dtype']} has no effect at {defaults.opt_level}: nothing runs in half.")
    if final.low_precision_layernorm and not final.patch_torch_functions:
        notes.append(
            f"low_precision_layernorm=True has no effect at {defaults.opt_level}: it only changes "
            f"LayerNorm under autocast (O1/O4); a model cast to half already runs LayerNorm in half."
        )
    return defaults, final, applied, notes


def _resolve_update(level: str, final: Properties, applied: dict) -> Tuple[Properties, List[str]]:
    """Settle ``update_rounding`` and ``optimizer_state_dtype`` (after the half dtype is known):
    they apply only to a model cast to half without master weights; elsewhere they become None."""
    notes = []
    cast = final.cast_model_type
    cast = (final.half_dtype or torch.float16) if cast == HALF_DTYPE else cast
    if final.update_rounding is not None:
        why = None
        if cast not in HALF_DTYPES:
            why = "the model is not cast to a half dtype, so the optimizer already updates float32 weights"
        elif final.master_weights:
            why = "with master_weights=True the update lands in the float32 masters"
        if why is not None:
            if "update_rounding" in applied:
                notes.append(f"update_rounding={final.update_rounding!r} has no effect at {level}: {why}.")
            final = dataclasses.replace(final, update_rounding=None)
        elif final.update_rounding == "stochastic" and cast != torch.bfloat16:
            raise ValueError(
                f"initialize(update_rounding='stochastic'): stochastic rounding is implemented for bfloat16 "
                f"weights, but the model is cast to {cast}; pass half_dtype=torch.bfloat16, or "
                f"update_rounding='nearest'."
            )
    if final.optimizer_state_dtype == STATE_8BIT and final.update_rounding is None:
        raise ValueError(
            f"initialize(optimizer_state_dtype={STATE_8BIT!r}): 8-bit optimizer state needs the transient fp32 "
            f"update (update_rounding on a half model without master weights: O7, O8), but at {level} with these "
            f"options update_rounding is None (cast_model_type={cast}, master_weights={final.master_weights!r}). "
            f"Use opt_level='O8' (or 'O7' with optimizer_state_dtype='8bit') without master_weights=True or "
            f"update_rounding=False, or here {_dtype_name(STATE_DTYPES)} or None."
        )
    if final.optimizer_state_dtype is not None and final.update_rounding is None and final.master_weights != REMAINDER:
        notes.append(
            f"optimizer_state_dtype={final.optimizer_state_dtype} has no effect at {level}: it sets how "
            f"optimizer state is stored between steps only where ampkit computes the update "
            f"(update_rounding, a half model without master weights)."
        )
        final = dataclasses.replace(final, optimizer_state_dtype=None)
    return final, notes


def table_rows() -> Tuple[List[str], List[List[str]]]:
    """``(column names, rows)`` of the property table: what ``ampkit levels`` and the docs show."""
    names = ["level"] + list(OVERRIDES)
    return names, [[lvl] + [_show(getattr(p, n)) for n in OVERRIDES] for lvl, p in OPT_LEVELS.items()]


def format_table() -> str:
    """The property table as aligned text (what ``ampkit levels`` prints)."""
    names, rows = table_rows()
    briefs = [f"{lvl}: {BRIEF[lvl]}" for lvl in OPT_LEVELS]
    return "\n".join([text_table.format_table(names, rows, left=len(names)), ""] + briefs)


def markdown_table() -> str:
    """The same table as markdown, each level's one-line description below it (README, docs)."""
    names, rows = table_rows()
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines + [""] + [f"- **{lvl}**: {BRIEF[lvl]}" for lvl in OPT_LEVELS])


def _show(value) -> str:
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    return str(value)
