"""Step 6, report: the NoEffectWarnings, the one-line (or full) summary of the level, and
warnings about choices that will train badly."""
import logging
import warnings

import torch

from .._common.errors import NoEffectWarning
from .._common.logs import is_main_process
from .._config import levels
from .._run.run import Run
from .plan import Plan

_reported = set()  # one-time notes already logged in this process: (device type, what)


def report(plan: Plan, run: Run) -> None:
    for note in plan.notes:
        warnings.warn(note, NoEffectWarning, stacklevel=3)
    if run.verbosity == 0:
        return
    if is_main_process():
        run.log("%s", _banner(plan, run))
        for info in plan.infos:
            run.log("%s", info)
    _warn_eps(plan, run)
    _note_cpu_float16(plan.props, run)


def _banner(plan: Plan, run: Run) -> str:
    defaults, props = plan.defaults, plan.props
    if run.verbosity == 1:
        return f"ampkit {defaults.opt_level}: {summary(props, plan.use_masters)}"
    lines = [f"Selected optimization level {defaults.opt_level}:  {levels.BRIEF[defaults.opt_level]}",
             "Defaults for this optimization level are:"]
    lines += [f"{k:24}: {levels._show(v)}" for k, v in defaults.rows()]
    lines.append("Overrides applied: " + (", ".join(f"{k}={levels._show(v)}" for k, v in plan.applied.items()) or "none"))
    lines.append("After processing overrides, optimization options are:")
    lines += [f"{k:24}: {levels._show(v)}" for k, v in props.rows()]
    return "\n".join(lines)


def _warn_eps(plan: Plan, run: Run) -> None:
    """An eps that rounds to 0 in the half dtype the optimizer steps in (no masters)."""
    props = plan.props
    half = props.cast_model_type if props.cast_model_type in levels.HALF_DTYPES else None
    if half is None or plan.use_masters or props.update in (levels.UpdateKind.ROUNDED, levels.UpdateKind.EIGHT_BIT):  # fp32 step
        return
    for opt in plan.request.optimizers:
        eps = [g["eps"] for g in opt.param_groups if isinstance(g.get("eps"), float)]
        if eps and torch.tensor(min(eps), dtype=half).item() == 0.0:
            run.log("%s eps=%s rounds to 0 in %s and the optimizer steps on %s weights (no master "
                    "weights at %s): expect inf/NaN updates; use master_weights=True or a larger eps.",
                    type(opt).__name__, min(eps), half, half, props.opt_level, level=logging.WARNING)


def _note_cpu_float16(props, run: Run) -> None:
    uses_fp16 = props.cast_model_type == torch.float16 or (props.patch_torch_functions and props.half_dtype == torch.float16)
    key = (run.device_type, "float16")
    if uses_fp16 and run.device_type != "cuda" and key not in _reported:
        _reported.add(key)
        run.log(
            "float16 on %s is honoured as requested, but it is usually slow there (no fast float16 "
            "kernels); bfloat16 (O4/O5, or half_dtype=torch.bfloat16) is the fast path on CPUs.",
            run.device_type,
        )


def summary(props, use_masters: bool) -> str:
    """One line on what a resolved level does: model dtype, autocast, masters, loss scale."""
    cast = props.cast_model_type
    parts = [f"model {levels._show(cast)}" if cast is not None else "model dtype unchanged"]
    if cast in levels.HALF_DTYPES and props.keep_batchnorm_fp32:
        parts[0] += " (BatchNorm float32)"
    if props.patch_torch_functions:
        parts.append(f"autocast to {levels._show(props.half_dtype)}")
    if props.update is levels.UpdateKind.REMAINDER:
        parts.append("fp32 master weights as bf16 weight + 16-bit remainder")
    else:
        parts.append("fp32 master weights" if use_masters else "no master weights")
    scale = props.loss_scale
    parts.append("dynamic loss scale" if scale == "dynamic" else f"static loss scale {scale}")
    return ", ".join(parts)
