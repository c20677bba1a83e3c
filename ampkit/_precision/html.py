"""The precision report as one self-contained HTML page, and as a PNG (with matplotlib).

Both work from `PrecisionReport.to_dict`'s data (one page may hold several reports). The page has inline CSS and CSS
bars only: no script, no image, no link to anything outside it.
"""
from html import escape
from pathlib import Path
from typing import Dict, List

CSS = """
body { font: 13px/1.4 system-ui, sans-serif; margin: 24px; color: #1d2330; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 22px 0 8px; } h3 { font-size: 15px; margin: 16px 0 6px; }
.meta { color: #555; max-width: 1100px; }
.rec { background: #eef6ee; border-left: 4px solid #3a8a3a; padding: 8px 12px; max-width: 1100px; }
ul.verdicts { padding: 0; list-style: none; } ul.verdicts li { margin: 3px 0; padding: 3px 8px; border-radius: 3px; }
li.clean { background: #eef6ee; } li.warns { background: #fff6df; } li.fails { background: #fde8e8; }
table { border-collapse: collapse; } th, td { padding: 3px 4px; border-bottom: 1px solid #e3e5ea; text-align: left; }
th { font-size: 11px; background: #f4f5f8; position: sticky; top: 0; max-width: 56px; }
td.name { font-family: ui-monospace, monospace; white-space: nowrap; } td.type { color: #666; white-space: nowrap; }
.bar { position: relative; width: 56px; height: 16px; background: #f0f1f4; }
.bar .fill { position: absolute; left: 0; top: 0; bottom: 0; background: #7fb27f; }
.bar.over .fill { background: #d9534f; }
.bar .limit { position: absolute; left: 50%; top: 0; bottom: 0; border-left: 1px dashed #888; }
.bar span { position: absolute; left: 4px; top: 0; font-size: 11px; line-height: 16px; }
td.na { color: #aaa; text-align: center; }
dl dt { font-weight: 600; } dl dd { margin: 0 0 6px 16px; color: #444; }
"""


def _width(value: float, limit: float) -> float:
    """Bar length in percent: the limit sits at 50%; anything over it gets at least 55%."""
    ref = limit if limit > 0 else 0.01
    width = min(100.0, 50.0 * value / ref)
    return max(width, 55.0) if value > limit else width


def _cell(value, metric: dict) -> str:
    if value is None:
        return '<td class="na">-</td>'
    over = value > metric["limit"]
    exact = "0" if value == 0 else f"{100 * value:.3g}%"
    label = "&lt;0.01%" if 0 < value < 1e-4 else exact
    return (f'<td><div class="bar{" over" if over else ""}" title="{exact}: {escape(metric["text"])}">'
            f'<div class="fill" style="width:{_width(value, metric["limit"]):.1f}%"></div><div class="limit"></div>'
            f"<span>{label}</span></div></td>")


def _layers(data: dict) -> List[str]:
    head = "".join(f'<th title="{escape(m["text"])}">{escape(m["header"])}</th>' for m in data["metrics"])
    out = ['<table class="layers">', f"<thead><tr><th>layer</th><th>type</th>{head}</tr></thead>", "<tbody>"]
    for layer in data["layers"]:
        kind = layer["type"] if layer["kind"] == "module" else f'{layer["type"]} param'
        cells = "".join(_cell(layer["values"][m["key"]], m) for m in data["metrics"])
        out.append(f'<tr class="layer"><td class="name">{escape(layer["name"] or "(model)")}</td>'
                   f'<td class="type">{escape(kind)}</td>{cells}</tr>')
    return out + ["</tbody></table>"]


def _report(data: dict, h: str) -> List[str]:
    """One report's sections, headed by ``<h>`` tags."""
    rec = data["recommendation"]
    verdicts = "".join(f'<li class="{escape(v["status"])}">{escape(v["line"])}</li>' for v in data["verdicts"])
    legend = "".join(f'<dt>{escape(m["header"])}</dt><dd>{escape(m["text"])}; a finding above {100 * m["limit"]:.3g}%</dd>'
                     for m in data["metrics"])
    return [
        f'<p class="meta">{escape(data["summary"])}</p>',
        f"<{h}>Recommendation</{h}>", f'<p class="rec"><b>{escape(rec["level"])}</b>: {escape(rec["reason"])}</p>',
        f"<{h}>Verdicts</{h}>", f'<ul class="verdicts">{verdicts}</ul>',
        f"<{h}>Layers, worst first</{h}>",
        '<p class="meta">Each bar is a share of elements; the dashed line marks the limit above which it is a finding (red).</p>',
        *_layers(data), f"<{h}>Columns</{h}>", f"<dl>{legend}</dl>",
    ]


def _page(body: List[str]) -> str:
    head = ['<!DOCTYPE html>', '<html lang="en"><head><meta charset="utf-8">',
            "<title>ampkit precision report</title>", f"<style>{CSS}</style></head><body>",
            "<h1>ampkit precision report</h1>"]
    return "\n".join(head + body + ["</body></html>"]) + "\n"


def render(data: dict) -> str:
    """The page of one report (`PrecisionReport.to_dict`'s data), as a string."""
    return _page(_report(data, "h2"))


def render_models(reports: Dict[str, dict]) -> str:
    """One page holding several reports (model name -> its ``to_dict()``), each under its name."""
    body = []
    for name, data in reports.items():
        body += [f'<h2 id="{escape(name)}">{escape(name)}</h2>', *_report(data, "h3")]
    return _page(body)


def plot(data: dict, path: Path) -> Path:
    """A PNG heat map: one row per layer (worst first, at most 60), one column per figure, value / limit."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(f"PrecisionReport.plot needs matplotlib: pip install matplotlib ({e}).") from e
    layers, metrics = data["layers"][:60], data["metrics"]
    ratios = [[min(4.0, (l["values"][m["key"]] or 0.0) / (m["limit"] or 0.01)) for m in metrics] for l in layers]
    fig = Figure(figsize=(1.2 + 0.7 * len(metrics), 1.5 + 0.25 * len(layers)))
    ax = fig.add_subplot()
    image = ax.imshow(ratios, aspect="auto", cmap="Reds", vmin=0.0, vmax=4.0)
    ax.set_xticks(range(len(metrics)), [m["header"] for m in metrics], rotation=45, ha="right")
    ax.set_yticks(range(len(layers)), [l["name"] or "(model)" for l in layers], fontsize=7)
    fig.colorbar(image, ax=ax, label="share / limit (capped at 4)")
    ax.set_title("ampkit precision report")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path
