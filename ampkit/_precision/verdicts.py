"""From measured counts to per-layer figures, per-level verdicts and a recommended level.

A *metric* is one share per layer (0 to 1), with the limit above which it is a *finding*.
Each opt level checks the metrics that its properties (``OPT_LEVELS``) make relevant: the
half dtype of its activations and gradients, its loss scale, whether the weights keep fp32
masters, stochastic rounding, fp8.
"""
import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .._config.levels import OPT_LEVELS, Properties
from .._hardware import SLOWER, SPEED, Capabilities
from .measure import DYNAMIC_START, FP16_OVERFLOW, SCALE_EXPONENTS, Measurements, Stats

FAILS, WARNS, NOTE = "fails", "warns", "note"
SEVERITY_RANK = {NOTE: 1, WARNS: 2, FAILS: 3}
SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16"}
LONG = {"fp16": "float16", "bf16": "bfloat16"}
MODULE, PARAMETER = "module", "parameter"


@dataclasses.dataclass(frozen=True)
class Metric:
    """One column: ``key``, its ``header`` in the text table, the ``limit`` a share must exceed
    to be a finding, and what it measures."""

    key: str
    header: str
    limit: float
    text: str


FLUSH_LIMIT, LOST_LIMIT, FP8_LIMIT = 0.01, 0.1, 0.125
METRICS = (
    Metric("nonfinite", "NaN/inf", 0.0, "outputs that are NaN/inf in fp32 although every input was finite"),
    Metric("act_overflow_fp16", "act ovf16", 0.0, "outputs above float16's range (they become inf)"),
    Metric("act_flush_fp16", "act ftz16", FLUSH_LIMIT, "nonzero outputs that float16 rounds to zero"),
    Metric("act_overflow_bf16", "act ovf bf16", 0.0, "outputs above bfloat16's range"),
    Metric("act_flush_bf16", "act ftz bf16", FLUSH_LIMIT, "nonzero outputs that bfloat16 rounds to zero"),
    Metric("grad_overflow_fp16_dynamic", "grad ovf16", 0.0,
           "gradients that overflow float16 at a dynamic loss scale's start, 2**16 (a skipped step each)"),
    Metric("grad_flush_fp16_dynamic", "grad ftz16", FLUSH_LIMIT,
           "nonzero gradients that float16 rounds to zero at the scale the dynamic scale settles at"),
    Metric("grad_overflow_fp16_static", "grad ovf16@1", 0.0, "gradients that overflow float16 unscaled (O3)"),
    Metric("grad_flush_fp16_static", "grad ftz16@1", FLUSH_LIMIT, "nonzero gradients that float16 rounds to zero unscaled (O3)"),
    Metric("grad_flush_bf16", "grad ftz bf16", FLUSH_LIMIT, "nonzero gradients that bfloat16 rounds to zero"),
    Metric("lost_bf16", "lost bf16", LOST_LIMIT,
           "nonzero fp32 updates that a bfloat16 weight loses under round-to-nearest (below half an ulp)"),
    Metric("lost_fp16", "lost fp16", LOST_LIMIT, "nonzero fp32 updates that a float16 weight loses (below half an ulp)"),
    Metric("fp8_error", "fp8 err", FP8_LIMIT,
           "relative error (Frobenius) of the emulated fp8 e4m3 matmul against fp32, Linear layers O6 converts"),
)
BY_KEY = {m.key: m for m in METRICS}


@dataclasses.dataclass(frozen=True)
class Row:
    """One leaf module (its outputs and their gradients) or one parameter (its gradient and updates)."""

    name: str
    kind: str
    type: str
    values: Dict[str, Optional[float]]

    def over(self, key: str) -> bool:
        value = self.values.get(key)
        return value is not None and value > BY_KEY[key].limit


def settled_scale(m: Measurements) -> float:
    """Where a dynamic float16 scale starting at 2**16 ends up: halved until no gradient overflows."""
    amax = max((s.amax for s in [*m.grads.values(), *m.output_grads.values()]), default=0.0)
    scale = DYNAMIC_START
    while scale > 2.0 ** SCALE_EXPONENTS[-1] and amax * scale >= FP16_OVERFLOW:
        scale /= 2
    return scale


def _grad_values(s: Optional[Stats], settled: float) -> Dict[str, Optional[float]]:
    if s is None:
        return {}
    return {
        "grad_overflow_fp16_dynamic": s.overflow("float16", DYNAMIC_START),
        "grad_flush_fp16_dynamic": s.flush("float16", settled),
        "grad_overflow_fp16_static": s.overflow("float16"),
        "grad_flush_fp16_static": s.flush("float16"),
        "grad_flush_bf16": s.flush("bfloat16"),
    }


def rows(m: Measurements) -> List[Row]:
    """Every leaf module with outputs and every parameter with a gradient, in model order."""
    settled, out = settled_scale(m), []
    for name, kind in m.modules.items():
        act = m.activations.get(name)
        if act is None:
            continue
        values = {f"act_{w}_{d}": getattr(act, w)(LONG[d]) for w in ("overflow", "flush") for d in ("fp16", "bf16")}
        values["nonfinite"] = m.produced.get(name, 0) / max(act.numel, 1)
        values.update(_grad_values(m.output_grads.get(name), settled))
        if name in m.fp8:
            values["fp8_error"] = m.fp8[name].matmul_error
        out.append(Row(name, MODULE, kind, values))
    for name, owner in m.params.items():
        values = _grad_values(m.grads.get(name), settled)
        if name in m.lost:
            values.update({"lost_bf16": m.lost[name]["bfloat16"], "lost_fp16": m.lost[name]["float16"]})
        if values:
            out.append(Row(name, PARAMETER, m.modules.get(owner, "parameter"), values))
    return out


@dataclasses.dataclass(frozen=True)
class Finding:
    """Layers over one metric's limit at one level, and what that means there."""

    severity: str
    metric: str
    layers: Tuple[str, ...]
    text: str


@dataclasses.dataclass(frozen=True)
class Verdict:
    level: str
    findings: Tuple[Finding, ...]

    @property
    def status(self) -> str:
        severities = {f.severity for f in self.findings}
        return FAILS if FAILS in severities else WARNS if WARNS in severities else "clean"

    def line(self) -> str:
        if not self.findings:
            return f"{self.level}: clean"
        parts = [("note: " if f.severity == NOTE else "") + f.text for f in self.findings]
        return f"{self.level}: " + ("clean; " if self.status == "clean" else "") + "; ".join(parts)


def _scale_text(scale: float) -> str:
    return f"{scale:g}" if scale >= 1 else f"2**{int(math.log2(scale))}"


def checks(props: Properties, settled: float) -> List[Tuple[str, str, str]]:
    """(metric, severity, what it means) for each metric level ``props`` depends on; ``{n}`` is the count."""
    out = [("nonfinite", FAILS, "NaN/inf produced in fp32 already by {n} (no precision fixes that)")]
    half = SHORT.get(props.half_dtype)
    if half is None:
        return out
    over = f"over {FLUSH_LIMIT:.0%} of"
    out += [(f"act_overflow_{half}", FAILS, f"activations overflow {half} in {{n}} (inf in the forward pass: every step is skipped)"),
            (f"act_flush_{half}", WARNS, f"{over} activations flush to zero in {half} in {{n}}")]
    if half == "bf16":
        out.append(("grad_flush_bf16", WARNS, f"{over} gradients flush to zero in bf16 in {{n}}"))
    elif props.loss_scale == "dynamic":
        skips, at = round(math.log2(DYNAMIC_START / settled)), _scale_text(settled)
        out += [("grad_overflow_fp16_dynamic", WARNS, f"gradients overflow fp16 at scale {DYNAMIC_START:g} in {{n}} "
                 f"(about {skips} skipped step(s) while the dynamic scale backs off to {at})"),
                ("grad_flush_fp16_dynamic", WARNS, f"{over} gradients flush to zero in fp16 at scale {at} in {{n}}")]
    else:
        out += [("grad_overflow_fp16_static", FAILS, "gradients overflow fp16 at scale 1 in {n} (every step is skipped)"),
                ("grad_flush_fp16_static", WARNS, f"{over} gradients flush to zero in fp16 at scale 1 in {{n}}")]
    if props.cast_model_type is not None and props.cast_model_type != torch.float32 and not props.has_masters:
        lost = f"over {LOST_LIMIT:.0%} of updates"
        if props.update_rounding == "stochastic":
            out.append((f"lost_{half}", NOTE, f"{lost} are below half a {half} ulp in {{n}} (round-to-nearest would lose "
                        f"them; stochastic rounding keeps them in expectation)"))
        else:
            out.append((f"lost_{half}", WARNS, f"{lost} are lost in {half} (no fp32 master weights) in {{n}}"))
    if props.fp8:
        out.append(("fp8_error", WARNS, f"fp8 matmul error over {FP8_LIMIT:.1%} in {{n}} (keep them out with fp8_exclude)"))
    return out


def _count(names: Sequence[str], kind: str) -> str:
    noun = {MODULE: "layer", PARAMETER: "parameter"}[kind]
    return f"{len(names)} {noun}{'s' if len(names) != 1 else ''}"


SHOWN = 8  # names listed in a finding's text (Finding.layers has them all)


def _names(names: Sequence[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def verdict(level: str, table: List[Row], settled: float) -> Verdict:
    """What ``level`` would do to this model, from the rows' figures."""
    findings = []
    for key, severity, text in checks(OPT_LEVELS[level], settled):
        for kind in (MODULE, PARAMETER):
            names = tuple(r.name for r in table if r.kind == kind and r.over(key))
            if names:
                findings.append(Finding(severity, key, names, text.format(n=_count(names, kind)) + ": " + _names(names)))
    return Verdict(level, tuple(findings))


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """The level for this model on this machine, why, and which layers to keep out of fp8 / half.

    ``keep_fp32`` is set only at an autocast level (O1/O4), where wrapping those layers'
    forward in ``ampkit.disable_casts()`` runs them in fp32; ``fp8_exclude`` only at O6
    (pass it to ``initialize(..., fp8_exclude=...)``).
    """

    level: str
    reason: str
    fp8_exclude: Tuple[str, ...] = ()
    keep_fp32: Tuple[str, ...] = ()
    device: str = ""

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "fp8_exclude": list(self.fp8_exclude), "keep_fp32": list(self.keep_fp32)}


PREFERENCES = ("speed", "memory")


def preference(caps: Capabilities, prefer: str) -> List[str]:
    """Levels to try, best first. O3 (fp16 without masters or loss scaling) is never recommended.
    For speed only the levels ``caps`` finds faster than O0 (measured where the probe ran)."""
    if prefer == "memory":
        return ["O7", "O5", "O2", "O4", "O1", "O0"]
    if caps.fast(torch.bfloat16):
        return (["O6"] if caps.levels.get("O6") == SPEED else []) + ["O5", "O4", "O0"]
    if caps.fast(torch.float16):
        return ["O2", "O1", "O0"]
    return ["O0"]


def _why(level: str, caps: Capabilities, prefer: str) -> str:
    if level == "O0" and prefer == "speed" and not (caps.fast(torch.bfloat16) or caps.fast(torch.float16)):
        return (f"No half dtype is faster than float32 on {caps.line()}, so no half level runs faster than O0; "
                f"recommend(prefer='memory') names a level that saves memory.")
    if level == "O0":
        return f"No half-precision level that this report judged suits this model on {caps.line()}."
    if prefer == "memory":
        slower = caps.levels.get(level) == SLOWER
        return ("The least memory that this model's numbers allow"
                + (" (bf16 weights without fp32 masters)" if level == "O7" else "") + f", on {caps.line()}."
                + (f" {level} runs slower than O0 here: pick it for the memory, not for speed." if slower else ""))
    fast = "fp8 matmuls and bfloat16 are" if level == "O6" else "bfloat16 is" if level in ("O4", "O5") else "float16 is"
    return f"{fast[0].upper()}{fast[1:]} faster than float32 on {caps.line()}."


def _blocking(level: str, v: Verdict) -> Tuple[List[Finding], Tuple[str, ...]]:
    """Findings that rule ``level`` out, and the layers to keep fp32 (autocast levels) instead."""
    blocking = [f for f in v.findings if f.severity == FAILS and f.metric != "nonfinite"]
    if not OPT_LEVELS[level].patch_torch_functions:
        return blocking, ()
    keep = tuple(n for f in blocking if f.metric.startswith("act_overflow") for n in f.layers)
    return [f for f in blocking if not f.metric.startswith("act_overflow")], keep


def _accepted(level: str, v: Verdict, keep: Tuple[str, ...], caps: Capabilities, prefer: str, notes: List[str]) -> Recommendation:
    fp8 = tuple(n for f in v.findings if f.metric == "fp8_error" for n in f.layers)
    if keep:
        notes.append(f"Keep {', '.join(keep)} in fp32: wrap their forward in ampkit.disable_casts().")
    notes += [f"Fix first: {f.text}." for f in v.findings if f.metric == "nonfinite"]
    notes += [f"At {level}: {f.text}." for f in v.findings if f.severity != FAILS and f.metric != "fp8_error"]
    if fp8:
        notes.append(f"Pass fp8_exclude={list(fp8)} to initialize.")
    return Recommendation(level, " ".join([_why(level, caps, prefer)] + notes), fp8, keep, caps.device)


def recommend(verdicts: Dict[str, Verdict], caps: Capabilities, prefer: str) -> Recommendation:
    """The first level of `preference` among ``verdicts`` that nothing rules out; O0 at worst
    (nothing but NaN/inf already in fp32 fails there, and that rules no level out)."""
    order = [lvl for lvl in preference(caps, prefer) if lvl != "O0"]
    notes = [f"{lvl} was not judged (pass it in levels)." for lvl in order if lvl not in verdicts]
    for level in [lvl for lvl in order if lvl in verdicts]:
        blocking, keep = _blocking(level, verdicts[level])
        if not blocking:
            return _accepted(level, verdicts[level], keep, caps, prefer, notes)
        notes.append(f"{level} is ruled out: {blocking[0].text}.")
    return _accepted("O0", verdicts["O0"], (), caps, prefer, notes)
