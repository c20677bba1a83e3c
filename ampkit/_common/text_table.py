"""Aligned plain-text tables: what ``ampkit levels``, the demo and the benchmarks print."""
from typing import Sequence


def format_table(head: Sequence[str], body: Sequence[Sequence[str]], left: int = 0) -> str:
    """``head`` and the rows of ``body`` (strings) as columns two spaces apart, under a dashed
    rule; the first ``left`` columns are left-aligned, the rest right-aligned."""
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]

    def line(cells):
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(row) for row in body])
