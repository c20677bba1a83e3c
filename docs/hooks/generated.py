"""mkdocs hook: the parts of the site that are generated from the code, so a page and the code cannot disagree.

Markers (an HTML comment on a line of its own) are replaced in ``on_page_markdown``:

* ``<!-- ampkit:levels -->``: the opt-level table, from ``ampkit._config.levels.markdown_table`` (what
  ``ampkit levels`` prints, as markdown);
* ``<!-- ampkit:api-top -->``: one mkdocstrings entry per public name of ``ampkit.__all__`` under its
  public path (``::: ampkit.initialize``; ``lazy_exports.py`` makes them members of ``ampkit``);
* ``<!-- ampkit:api ampkit.checkpoint -->`` (optionally followed by a heading level): that public
  module's mkdocstrings entry, limited to the names of its ``__all__`` (read statically);
* ``<!-- ampkit:switches -->``: every ``AMPKIT_*`` environment switch, from ``ampkit._common.switches``;
* ``<!-- ampkit:layers -->``: the package's layers as an inline SVG, from ``LAYERS`` in
  ``tests/test_layers.py`` (read statically) and the modules found under ``ampkit/``;
* ``<!-- ampkit:bench-method -->``: per benchmark family and script, its command and its docstring
  (what it measures, how, its targets), read statically from ``benchmarks/``;
* ``<!-- ampkit:bench-figures -->``: per committed ``run.py --json`` file, its machine line, command,
  plot, the rows of every family it holds and its targets table.

``on_files`` adds the benchmark figures, plotted at build time by ``benchmarks/plot.py`` from the
JSON files under ``docs/benchmarks/data/`` (written by ``benchmarks/run.py --json``), and the curves
of each ``run.py --only convergence --json`` file under ``docs/benchmarks/convergence/``, whose tables
``<!-- ampkit:convergence -->`` writes.

The level table imports ``ampkit._config`` (and so torch, which ``ampkit[docs]`` installs with
ampkit); the rest of the site is read statically, so the frameworks of ``ampkit.integrations`` need not
be installed.
"""
import ast
import html
import importlib.util
import json
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "docs" / "benchmarks" / "data"
FIGURES = "benchmarks/figures"  # where the plots appear in the site
CONVERGENCE = ROOT / "docs" / "benchmarks" / "convergence"


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- generated markdown --------------------------------------------------------------------

def levels_table() -> str:
    from ampkit._config import levels

    return levels.markdown_table()


def switches_table() -> str:
    from ampkit._common.switches import SWITCHES

    lines = ["| variable | default | what it does |", "|---|---|---|"]
    for sw in SWITCHES:
        default = f"`{sw.default}`" if sw.default else "unset"
        lines.append(f"| `{sw.name}` | {default} | {sw.meaning.replace('|', '&#124;')} |")
    return "\n".join(lines)


def public_exports() -> dict:
    """``ampkit.__all__``'s names -> defining module ("" for a public submodule)."""
    return _load(Path(__file__).with_name("lazy_exports.py"), "ampkit_docs_exports").public_exports()


def api_top() -> str:
    """mkdocstrings entries for the top-level names (functions, classes, constants; submodules have their pages)."""
    return "\n".join(f"::: ampkit.{name}\n    options:\n      heading_level: 2\n"
                     for name, module in public_exports().items() if module)


def module_all(module: str) -> list:
    """The ``__all__`` of a public module, read from its source without importing it."""
    path = ROOT.joinpath(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "__all__":
            return list(ast.literal_eval(node.value))
    raise RuntimeError(f"{module} has no literal __all__")


def api_module(module: str, heading_level: int = 2) -> str:
    """One public module's entry: its docstring and the names of its ``__all__``, nothing else."""
    members = ", ".join(module_all(module))
    return (f"::: {module}\n    options:\n      show_root_heading: false\n      heading_level: {heading_level}\n"
            f"      members: [{members}]\n")


def layers() -> list:
    """``(layer, [module prefixes])`` from ``tests/test_layers.py``'s ``LAYERS``, lowest first."""
    tree = ast.parse((ROOT / "tests" / "test_layers.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "LAYERS":
            return [(name, list(prefixes)) for name, prefixes in ast.literal_eval(node.value)]
    raise RuntimeError("tests/test_layers.py has no LAYERS table")


def _modules() -> list:
    out = []
    for path in sorted((ROOT / "ampkit").rglob("*.py")):
        parts = ("ampkit",) + path.relative_to(ROOT / "ampkit").with_suffix("").parts
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def _layer_members(table: list) -> dict:
    """Layer name -> the names shown in its box: subpackages as ``name/``, top-level modules as ``name``."""
    members, counts = {name: [] for name, _ in table}, {}
    for module in _modules():
        best, layer = -1, None
        for name, prefixes in table:
            for p in prefixes:
                if (module == p or module.startswith(p + ".")) and len(p) > best:
                    best, layer = len(p), name
        parts = module.split(".")
        label = "ampkit" if len(parts) == 1 else (parts[1] + "/" if len(parts) > 2 or _is_package(parts) else parts[1])
        if layer is not None and label not in members[layer]:
            members[layer].append(label)
        counts[label] = counts.get(label, 0) + 1
    return {name: [f"{m}({counts[m]})" if m.endswith("/") else m for m in ms] for name, ms in members.items()}


def _is_package(parts) -> bool:
    return (ROOT.joinpath(*parts) / "__init__.py").exists()


def layers_svg() -> str:
    """The layers as boxes, highest first, each listing all its packages and modules, arrows pointing down."""
    table = layers()
    members = _layer_members(table)
    width, gap, left = 760, 26, 120
    rows = [(name, _wrap(" ".join(members[name]), 72)) for name, _ in reversed(table)]
    heights = [18 + 18 * max(2, len(lines)) for _, lines in rows]
    height = sum(heights) + gap * (len(rows) - 1) + 8
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" role="img" aria-label="ampkit package layers" '
             f'viewBox="0 0 {width} {height}" width="100%" style="max-width:{width}px;font-family:sans-serif">',
             "<defs><marker id='arrow' markerWidth='10' markerHeight='10' refX='9' refY='5' orient='auto'>"
             "<path d='M0,0 L10,5 L0,10 z' fill='#555'/></marker></defs>"]
    y = 4
    for i, ((name, lines), box_h) in enumerate(zip(rows, heights)):
        parts.append(f'<rect x="4" y="{y}" width="{width - 8}" height="{box_h}" rx="6" fill="#eef0fb" stroke="#3f51b5"/>')
        parts.append(f'<text x="16" y="{y + 22}" font-size="16" font-weight="bold" fill="#283593">{html.escape(name)}</text>')
        for j, line in enumerate(lines):
            parts.append(f'<text x="{left}" y="{y + 20 + 18 * j}" font-size="13" font-family="monospace" fill="#222">'
                         f'{html.escape(line)}</text>')
        if i + 1 < len(rows):
            parts.append(f'<line x1="{width / 2}" y1="{y + box_h}" x2="{width / 2}" y2="{y + box_h + gap - 4}" '
                         f'stroke="#555" stroke-width="2" marker-end="url(#arrow)"/>')
        y += box_h + gap
    parts.append("</svg>")
    return '<div class="ampkit-layers">\n' + "".join(parts) + "\n</div>"  # a raw HTML block: markdown leaves it alone


def _wrap(text: str, width: int) -> list:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return lines + ([line] if line else [])


def bench_figures() -> str:
    """Per committed ``benchmarks/run.py --json`` file: its machine, command, plot and the rows it holds."""
    out = []
    for path in sorted(DATA.glob("*.json")):
        data = json.loads(path.read_text())
        if "results" not in data:
            continue
        m = data["machine"]
        out += [f"### {m.get('cpu', '?')} ({path.name})", "",
                f"Machine: {m.get('cpu')} ({m.get('cpu_capability')}{', ' + m['cpu_flags'] if m.get('cpu_flags') else ''}), "
                f"{m.get('cores')} cores, {m.get('threads')} threads per run, torch {m.get('torch')}, Python {m.get('python')}, "
                f"device {m.get('device')}; 1-minute load average {m.get('load_average'):.1f} at the start and "
                f"{data.get('load_average_end', float('nan')):.1f} at the end. Command: "
                f"`python {' '.join(_argv(data.get('argv', ['benchmarks/run.py']), path))}`"
                f"{' (--quick: a smoke run, not valid for the targets)' if data.get('quick') else ''}.", ""]
        if _plotted(data):
            out += [f"![Speed-up and peak memory per level on {m.get('cpu')}](figures/{path.stem}.png)", ""]
        for family, result in data["results"].items():
            rows = result.get("rows") if isinstance(result, dict) else None
            if not rows:
                continue
            keys = [k for k in rows[0] if not isinstance(rows[0][k], (list, dict))]
            keys = [k for k in ("model", "level") if k in keys] + [k for k in keys if k not in ("model", "level")]
            sizes = f", sizes: {result['sizes']}" if result.get("sizes") else ""
            wall = f", {result['wall_s']:.0f} s" if isinstance(result.get("wall_s"), (int, float)) else ""
            out += [f"**{family}** (the JSON's rows{sizes}{wall})", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            out += ["| " + " | ".join(_cell(r.get(k)) for k in keys) + " |" for r in rows]
            shapes = "; ".join(f"{m}: `{result[m]}`" for m in ("lm", "cnn") if result.get(m))
            out += ["", f"Models: {shapes}." if shapes else "", ""]
        if data.get("targets"):
            out += ["**targets** (as the script judged them)", "", "| target | measured | met |", "|---|---|---|"]
            out += [f"| {t['target']} | {t['measured']} | {t['met']} |" for t in data["targets"]]
            out.append("")
    return "\n".join(out) if out else "No results are committed yet."


# The benchmark scripts whose method the method page shows, in its order: (heading, command, source).
BENCH_METHOD = [*[(name, f"python benchmarks/run.py --only {name}", f"benchmarks/families/{name}.py")
                  for name in ("overhead", "speedup", "unscale", "memory", "scaling", "compile", "update", "o7_compile",
                               "sgd_step")],
                ("frontier.py: the memory levels and their peers", "python benchmarks/frontier.py", "benchmarks/frontier.py"),
                ("update_speed.py: the masterless levels' step against O5", "python benchmarks/update_speed.py",
                 "benchmarks/update_speed.py"),
                ("fsdp.py: FSDP2 per-rank memory and step time", "python benchmarks/fsdp.py", "benchmarks/fsdp.py"),
                ("precision.py: what the precision report costs", "python benchmarks/precision.py", "benchmarks/precision.py"),
                ("exit_soak.py: a clean exit under torchrun", "python benchmarks/exit_soak.py", "benchmarks/exit_soak.py")]


def bench_method() -> str:
    """Per benchmark family or script: its command, its source and its docstring (what it measures, how,
    its targets), read statically, so the method page and the code cannot disagree."""
    out = []
    for heading, command, source in BENCH_METHOD:
        doc = ast.get_docstring(ast.parse((ROOT / source).read_text())) or ""
        doc = re.sub(r"\A\d+\.\s+\w+:\s*", "", doc)  # the family's "1. overhead: " prefix: the heading says it
        doc = re.sub(r":(?:class|func|meth|data|attr):`~?([^`]+)`", r"`\1`", doc).replace("``", "`")
        doc = doc if doc.startswith("ampkit") else doc[:1].upper() + doc[1:]
        out += [f"### {heading}", "", f"`{command}` (source: `{source}`)", "", doc, ""]
    return "\n".join(out)


def _argv(argv: list, path: Path) -> list:
    """The run's command with its ``--json`` output named as committed (the run wrote to a scratch path)."""
    return [f"docs/benchmarks/data/{path.name}" if i and argv[i - 1] == "--json" else a for i, a in enumerate(argv)]


def convergence_tables() -> str:
    """Per committed convergence JSON: its machine, command, wall time, one table per task and the curves."""
    plot = _load(ROOT / "benchmarks" / "plot.py", "ampkit_docs_plot")
    out = []
    for path in sorted(CONVERGENCE.glob("*.json")):
        data = json.loads(path.read_text())
        m, result = data["machine"], data["results"]["convergence"]
        out += [f"### {m.get('cpu', '?')} ({path.name}{', --quick: not valid for the targets' if data.get('quick') else ''})", "",
                f"{m.get('cores')} cores, {m.get('threads')} thread per run, torch {m.get('torch')}; 1-minute load average "
                f"{m.get('load_average'):.1f} at the start and {data.get('load_average_end', float('nan')):.1f} at the end; "
                f"{data['seconds'] / 60:.0f} minutes. Command: `python {' '.join(data.get('argv', []))}`.", ""]
        for task, cfg in result["tasks"].items():
            headers, cells = plot.convergence_table(result["rows"], task)
            epochs = next((r["epochs"] for r in result["rows"] if r["task"] == task and "epochs" in r), None)
            out += [f"**{task}**: {plot.convergence_metric(task)[0]}, {cfg['steps']} steps x {cfg['seeds']} seeds"
                    f"{f' ({epochs:.2g} epochs)' if epochs else ''}", "",
                    "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
            out += ["| " + " | ".join(c.replace("|", "&#124;") for c in row) + " |" for row in cells] + [""]
        if data.get("targets"):
            out += ["**targets** (as the script judged them)", "", "| target | measured | met |", "|---|---|---|"]
            out += [f"| {t['target']} | {t['measured']} | {t['met']} |" for t in data["targets"]] + [""]
        out += [f"![Held-out metric against steps on {m.get('cpu')}](figures/convergence-{path.stem}.png)", ""]
    return "\n".join(out) if out else "No results are committed yet."


def _cell(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


MARKERS = {
    "<!-- ampkit:bench-figures -->": bench_figures,
    "<!-- ampkit:bench-method -->": bench_method,
    "<!-- ampkit:levels -->": levels_table,
    "<!-- ampkit:api-top -->": api_top,
    "<!-- ampkit:layers -->": layers_svg,
    "<!-- ampkit:switches -->": switches_table,
    "<!-- ampkit:convergence -->": convergence_tables,
}


API_MODULE = re.compile(r"^<!-- ampkit:api (ampkit[\w.]*)(?: (\d))? -->$", re.M)


def on_page_markdown(markdown, page, config, files):
    for marker, make in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return API_MODULE.sub(lambda m: api_module(m[1], int(m[2] or 2)), markdown)


# --- benchmark figures plotted at build time -----------------------------------------------

def _plotted(data: dict) -> bool:
    """Whether a committed ``run.py --json`` file has what ``plot.py`` draws (speed-up or memory results)."""
    return "results" in data and bool({"speedup", "memory"} & set(data["results"]))


def benchmark_figures() -> dict:
    """Site path -> PNG bytes, one plot per ``benchmarks/run.py --json`` file in ``docs/benchmarks/data/``."""
    import io

    plot = _load(ROOT / "benchmarks" / "plot.py", "ampkit_docs_plot")
    out = {}
    for path in sorted(DATA.glob("*.json")):
        data = json.loads(path.read_text())
        if not _plotted(data):  # not a benchmarks/run.py file (e.g. a demo's --json), or nothing plot.py draws
            continue
        buffer = io.BytesIO()
        plot.plot(data["results"], data["machine"], buffer)
        out[f"{FIGURES}/{path.stem}.png"] = buffer.getvalue()
    for path in sorted(CONVERGENCE.glob("*.json")):
        data, buffer = json.loads(path.read_text()), io.BytesIO()
        plot.plot_convergence(data["results"]["convergence"], data["machine"], buffer)
        out[f"{FIGURES}/convergence-{path.stem}.png"] = buffer.getvalue()
    return out


def on_files(files, config):
    for uri, content in benchmark_figures().items():
        files.append(File.generated(config, uri, content=content))
    return files
