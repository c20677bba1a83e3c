"""``precision_report``: which layers of *this* model each opt level would hurt, and the level to use."""
import dataclasses
import itertools
import math
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import torch
from torch import nn

from .._common.text_table import format_table
from .._config.levels import OPT_LEVELS
from .._hardware import Capabilities, capabilities, model_device
from .._model.float8 import eligible
from . import html
from .measure import DYNAMIC_START, Measurements, measure
from .verdicts import (
    BY_KEY,
    METRICS,
    MODULE,
    PREFERENCES,
    SEVERITY_RANK,
    Metric,
    Recommendation,
    Row,
    checks,
    recommend,
    rows,
    settled_scale,
    verdict,
)

STEPS = 2  # fp32 training steps measured (one per batch)
DEFAULT_LEVELS = ("O1", "O2", "O3", "O4", "O5", "O6", "O7")


def _ratio(row: Row, key: str) -> float:
    value, limit = row.values.get(key) or 0.0, BY_KEY[key].limit
    return value / limit if limit else (math.inf if value > 0 else 0.0)


def _show(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return "0" if value == 0 else f"{100 * value:.3g}%"


class PrecisionReport:
    """What `precision_report` measured, worst layers first.

    ``print(report)`` shows the table and a verdict per level; `recommend` picks a level;
    `to_dict`, `to_html` and `plot` export it. Made by `precision_report`
    from its ``measurements``, the ``levels`` to judge and the device's ``caps`` (capabilities).

    Attributes:
        levels: the levels judged. capabilities: the device's half-precision support.
        settled_scale: where a dynamic fp16 loss scale starting at 2**16 settles on these gradients.
        metrics: the columns the levels depend on. rows: one per leaf module and per parameter, worst first.
        verdicts: level -> `Verdict`.
    """

    def __init__(self, measurements: Measurements, levels: Sequence[str], caps: Capabilities):
        self.measurements, self.levels, self.capabilities = measurements, tuple(levels), caps
        self.settled_scale = settled_scale(measurements)
        rank: Dict[str, int] = {}  # metric -> its gravest severity at these levels
        for lvl in self.levels:
            for key, severity, _ in checks(OPT_LEVELS[lvl], self.settled_scale):
                rank[key] = max(rank.get(key, 0), SEVERITY_RANK[severity])
        self.metrics: List[Metric] = [m for m in METRICS if m.key in rank]
        table = rows(measurements)
        order = {r.name: i for i, r in enumerate(table)}

        def worst(r: Row):
            over = [m.key for m in self.metrics if r.over(m.key)]
            return (-max((rank[k] for k in over), default=0), -len(over),
                    -max(_ratio(r, m.key) for m in self.metrics), order[r.name])

        self.rows: List[Row] = sorted(table, key=worst)
        self._all = {lvl: verdict(lvl, self.rows, self.settled_scale) for lvl in dict.fromkeys(("O0", *self.levels))}
        self.verdicts = {lvl: self._all[lvl] for lvl in self.levels}

    def findings(self, row: Row) -> List[str]:
        """The metrics (of this report's levels) over their limit in ``row``."""
        return [m.key for m in self.metrics if row.over(m.key)]

    def table(self) -> str:
        """The rows as an aligned text table, worst first."""
        head = ["layer", "type"] + [m.header for m in self.metrics]
        body = [[r.name or "(model)", r.type if r.kind == MODULE else f"{r.type} param"]
                + [_show(r.values.get(m.key)) for m in self.metrics] for r in self.rows]
        return format_table(head, body, left=2)

    def _summary(self) -> str:
        m = self.measurements
        steps = ", ".join(f"{loss:.4g}" + ("" if ok else " (not applied: non-finite)") for loss, ok in zip(m.losses, m.applied))
        return (f"{len(m.losses)} fp32 training step(s) on a copy, optimizer {m.optimizer}, loss {steps}; "
                f"{self.capabilities.line()}. A dynamic fp16 loss scale would settle at {self.settled_scale:g} "
                f"(from {DYNAMIC_START:g}).")

    def __str__(self) -> str:
        legend = [f"  {m.header}: {m.text} (a finding above {m.limit:.3g})" for m in self.metrics]
        lines = [f"  {v.line()}" for v in self.verdicts.values()]
        return "\n".join([self._summary(), "", self.table(), "", "Columns, as shares of elements:", *legend, "",
                          "Verdicts:", *lines])

    def recommend(self, prefer: str = "speed", capabilities: Optional[Capabilities] = None) -> Recommendation:
        """The level for this model on this machine (``capabilities``: another device's, to ask "what if").

        ``prefer="speed"``: the fastest level the numbers allow among those faster than O0 on the
        device (``capabilities``, measured where the probe ran): O6 with native fp8, else O5, O4
        where bfloat16 is fast; O2, O1 where only float16 is; O0 where neither is.
        ``prefer="memory"``: O7, O5, O2, O4, O1 in that order, fast or not (the reason says when the
        level runs slower than O0 there).
        A level is ruled out by activations that overflow its half dtype (at O1/O4 those layers
        go to ``keep_fp32`` instead) or gradients that overflow an unscaled fp16 step; only
        levels this report judged are considered, and O0 is the fallback.
        """
        if prefer not in PREFERENCES:
            raise ValueError(f"recommend(prefer={prefer!r}): expected one of {', '.join(map(repr, PREFERENCES))}.")
        return recommend(self._all, capabilities or self.capabilities, prefer)

    def to_dict(self) -> dict:
        """Everything in the report as plain JSON-ready data (``json.dumps(..., allow_nan=False)``
        accepts it): a number that is not finite, such as a NaN loss, is ``None``."""
        m = self.measurements
        return _json_ready({
            "summary": self._summary(), "device": self.capabilities.line(), "levels": list(self.levels),
            "optimizer": m.optimizer, "losses": list(m.losses), "applied": list(m.applied),
            "dynamic_scale": {"start": DYNAMIC_START, "settled": self.settled_scale},
            "metrics": [{"key": x.key, "header": x.header, "limit": x.limit, "text": x.text} for x in self.metrics],
            "layers": [self._layer(r) for r in self.rows],
            "verdicts": [{"level": v.level, "status": v.status, "line": v.line(),
                          "findings": [{"severity": f.severity, "metric": f.metric, "layers": list(f.layers), "text": f.text}
                                       for f in v.findings]} for v in self.verdicts.values()],
            "recommendation": self.recommend().to_dict(),
        })

    def _layer(self, r: Row) -> dict:
        out = {"name": r.name, "kind": r.kind, "type": r.type, "findings": self.findings(r),
               "values": {x.key: r.values.get(x.key) for x in self.metrics}}
        fp8 = self.measurements.fp8.get(r.name) if r.kind == MODULE else None
        if fp8 is not None and "fp8_error" in out["values"]:
            out["fp8"] = dataclasses.asdict(fp8)  # matmul error and the shares fp8 flushes to zero
        return out

    def to_html(self, path) -> Path:
        """Write the report as one self-contained HTML page (inline CSS, no script, no external reference)."""
        path = Path(path)
        path.write_text(html.render(self.to_dict()), encoding="utf-8")
        return path

    def plot(self, path) -> Path:
        """Write a PNG heat map of the figures (layers x columns); needs matplotlib."""
        return html.plot(self.to_dict(), Path(path))


def _json_ready(data):
    """``data`` with every non-finite float replaced by None (JSON has no NaN or infinity)."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: _json_ready(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_json_ready(v) for v in data]
    return data


def _check_model(model) -> None:
    """An fp32 model with real weights: the report measures fp32 training and judges each level itself."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"precision_report(model=...): expected an nn.Module, got {type(model).__name__}.")
    if any(getattr(m, "_ampkit", None) is not None for m in model.modules()):
        raise ValueError("precision_report(model=...): this model was returned by ampkit.initialize (cast, or "
                         "given master weights or 8-bit state); run the report on the fp32 model before initialize.")
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        if t.device.type == "meta":
            raise RuntimeError(f"precision_report(model=...): {name} is on the meta device; materialize the model "
                               f"first (e.g. model.to_empty(device='cpu') and load or initialize its weights).")


def _check_levels(levels) -> tuple:
    accepted = ", ".join(repr(k) for k in OPT_LEVELS)
    if levels is None:
        return DEFAULT_LEVELS
    if isinstance(levels, (list, tuple)) and levels and all(isinstance(x, str) and x in OPT_LEVELS for x in levels):
        return tuple(dict.fromkeys(levels))
    raise ValueError(f"precision_report(levels={levels!r}): expected None (all of O1-O7) or a non-empty list of "
                     f"opt level names, from {accepted}.")


def _check_optimizer(model: nn.Module, optimizer) -> None:
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"precision_report(optimizer=...): expected a torch.optim.Optimizer or None, got {type(optimizer).__name__}.")
    if getattr(optimizer, "_ampkit", None) is not None:
        raise ValueError("precision_report(optimizer=...): this optimizer was returned by ampkit.initialize; run the "
                         "report with the fp32 model and its optimizer before initialize.")
    own = {id(p) for p in model.parameters()}
    foreign = sum(id(p) not in own for g in optimizer.param_groups for p in g["params"])
    if foreign:
        raise ValueError(f"precision_report(optimizer=...): holds {foreign} parameter(s) that are not the model's.")


def _first_batches(batches) -> list:
    try:
        it = iter(batches)
    except TypeError:
        raise TypeError(f"precision_report(batches=...): expected an iterable of batches, got {type(batches).__name__}.") from None
    taken = list(itertools.islice(it, STEPS))
    if not taken:
        raise ValueError("precision_report(batches=...): expected at least one batch, got none.")
    return taken


def precision_report(model: nn.Module, loss_fn: Callable, batches: Iterable, optimizer=None, levels=None) -> PrecisionReport:
    """Measure, on a copy of ``model``, which layers each opt level would hurt.

    Runs one fp32 training step on each of the first two batches of ``batches`` (one if there
    is only one; an iterator is advanced by that much), on deep copies of ``model`` (in train
    mode) and ``optimizer`` (SGD with lr 1e-3 when None); a step whose gradients are not
    finite is not applied. ``loss_fn(model, batch)`` returns a scalar loss tensor. The model,
    the optimizer and the random number generators are left exactly as they were.
    ``levels``: the opt levels to judge (default O1-O7). ``model`` is the fp32 model before
    ``ampkit.initialize`` (one that went through it, or one on the meta device, is refused).
    """
    _check_model(model)
    if not callable(loss_fn):
        raise TypeError(f"precision_report(loss_fn=...): expected a callable loss_fn(model, batch), got {type(loss_fn).__name__}.")
    levels = _check_levels(levels)
    _check_optimizer(model, optimizer)
    taken = _first_batches(batches)
    fp8_names = eligible(model) if any(OPT_LEVELS[lvl].fp8 for lvl in levels) else []
    measured = measure(model, loss_fn, taken, optimizer, fp8_names)
    return PrecisionReport(measured, levels, capabilities(model_device(model) or "cpu"))
