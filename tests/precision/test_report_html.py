"""The HTML page: well formed, one row per reported layer, nothing loaded from outside it."""
from html.parser import HTMLParser

import pytest

from ampkit._precision import precision_report

from . import _models as M

VOID = {"meta", "br", "hr", "img", "input", "link", "col", "wbr", "source", "area", "base", "embed", "track"}


class Page(HTMLParser):
    """Tags, attributes, text per row of the layers table, and a check that every tag closes."""

    def __init__(self):
        super().__init__()
        self.tags, self.attrs, self.stack, self.rows, self.verdicts, self.doctype = [], [], [], [], [], None
        self._cell = None

    def handle_decl(self, decl):
        self.doctype = decl

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs += [(tag, k, v or "") for k, v in attrs]
        if tag not in VOID:
            self.stack.append(tag)
        classes = dict(attrs).get("class", "")
        if tag == "tr" and classes == "layer":
            self.rows.append([])
        if tag == "td" and self.stack[-3:-1] == ["tbody", "tr"] and self.rows:
            self._cell = self.rows[-1]
            self._cell.append("")
        if tag == "li":  # only the verdict list has items
            self.verdicts.append(classes)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()
        if tag == "td":
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell[-1] += data


@pytest.fixture(scope="module")
def report():
    net = M.overflow_net()
    return precision_report(net, M.loss_fn, M.batches(), M.adam(net))


def test_page_structure_and_one_row_per_layer(report, tmp_path):
    path = report.to_html(tmp_path / "report.html")
    page = Page()
    page.feed(path.read_text(encoding="utf-8"))
    page.close()
    assert page.doctype == "DOCTYPE html" and page.stack == []
    assert page.tags[:3] == ["html", "head", "meta"] and page.tags.count("table") == 1 and page.tags.count("style") == 1
    assert [row[0] for row in page.rows] == [r.name for r in report.rows]
    assert all(len(row) == 2 + len(report.metrics) for row in page.rows)
    assert page.rows[0][:2] == ["mid", "Linear"] and page.rows[0][3].strip() != "0"  # act ovf16 of mid
    statuses = [v.status for v in report.verdicts.values()]
    assert page.verdicts == statuses and statuses[1] == "fails"
    widths = [v for t, k, v in page.attrs if k == "style" and "width:" in v]
    assert len(widths) == sum(r.values.get(m.key) is not None for r in report.rows for m in report.metrics)


def test_page_references_nothing_outside_itself(report, tmp_path):
    text = report.to_html(tmp_path / "report.html").read_text(encoding="utf-8")
    page = Page()
    page.feed(text)
    assert not {"script", "link", "img", "iframe", "object", "embed"} & set(page.tags)
    assert [a for a in page.attrs if a[1] in ("src", "href", "action", "srcset")] == []
    assert "http" not in text and "url(" not in text and "@import" not in text
