"""Precision report: which layers of a model each opt level would hurt, measured on a copy.

``ampkit.precision.precision_report(model, loss_fn, batches, optimizer=None, levels=None)``
returns a :class:`PrecisionReport`; ``main_report(argv)`` is ``python -m ampkit report``.
"""
from .command import main_report
from .report import PrecisionReport, precision_report
from .verdicts import Recommendation, Verdict

__all__ = ["precision_report", "PrecisionReport", "Recommendation", "Verdict", "main_report"]
