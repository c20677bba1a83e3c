"""Precision report: which layers of a model each opt level would hurt, measured on a copy.

``ampkit.precision_report(model, loss_fn, batches, optimizer=None, levels=None)`` returns a
`PrecisionReport`; ``python -m ampkit report`` runs it on the demo models (``_cli/report.py``).
"""
from .report import PrecisionReport, precision_report
from .verdicts import Recommendation, Verdict

__all__ = ["precision_report", "PrecisionReport", "Recommendation", "Verdict"]
