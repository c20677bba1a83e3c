"""Every benchmark family is registered where the families are listed: run.py's FAMILIES, the docs
hook's method page, the method page's command line; each module has run, report and targets."""
import importlib
import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
ROOT = BENCHMARKS.parent


def _run_script():
    """benchmarks/run.py, loaded from its path (``tests/run/`` holds the name ``run``)."""
    spec = importlib.util.spec_from_file_location("benchmarks_run", BENCHMARKS / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RUN = _run_script()
LISTED = [f for f in RUN.FAMILIES if f != "convergence"]  # convergence has its own page


@pytest.mark.parametrize("name", RUN.FAMILIES)
def test_family_module_has_run_report_and_targets(name):
    module = importlib.import_module(f"families.{name}")
    assert all(callable(getattr(module, f, None)) for f in ("run", "report", "targets"))


@pytest.mark.parametrize("name", LISTED)
def test_family_is_on_the_method_page_and_its_commands(name):
    assert f'"{name}"' in (ROOT / "docs" / "hooks" / "generated.py").read_text()
    assert f"--only {','.join(LISTED)}]" in (ROOT / "docs" / "benchmarks" / "details.md").read_text()
    assert name in RUN.DEFAULT
