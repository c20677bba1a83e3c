"""Facts of the pages that the code can check: the README stays short and links into the site, and every
message of Troubleshooting's error table is one that ampkit (or torch, where the page says so) raises."""
import re

import pytest

from .blocks import REPO

pytestmark = pytest.mark.repo_files("README.md", "docs")


def test_readme_is_short_and_points_into_the_site():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for page in sorted((REPO / "docs").glob("*.md")):
        if page.name not in ("index.md", "contributing.md", "changelog.md"):  # the last two include a root file
            assert f"(docs/{page.name})" in text, f"README.md does not link docs/{page.name}"
    assert "(CHANGELOG.md)" in text and "(CONTRIBUTING.md)" in text
    assert "python -m mkdocs build --strict" in text


def error_table() -> list:
    page = (REPO / "docs" / "troubleshooting.md").read_text()
    section = page.split("## Errors and what they mean", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [(re.match(r"\| `([^`]+)`", row)[1], "(torch's)" in row) for row in rows]


def test_every_message_in_the_error_table_is_raised_by_the_code():
    source = "\n".join(p.read_text() for p in (REPO / "ampkit").rglob("*.py"))
    source += (REPO / "tests" / "reliability" / "BAD_INPUTS.md").read_text()  # messages built from parts
    rows = error_table()
    assert len(rows) >= 8
    for fragment, torchs in rows:
        if not torchs:
            assert fragment in source, f"Troubleshooting quotes {fragment!r}, which no ampkit message contains"


@pytest.mark.repo_files("CONTRIBUTING.md")
def test_the_numerics_command_has_its_own_inductor_cache_wherever_it_is_given():
    """Without a fresh ``TORCHINDUCTOR_CACHE_DIR`` inductor hands the portable-kernel pass the kernels an
    earlier run compiled for this CPU's SIMD width (CONTRIBUTING.md says why)."""
    command = 'ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python -m pytest -q -m "numerics'
    for page in ("README.md", "CONTRIBUTING.md"):
        assert command in (REPO / page).read_text(), page


@pytest.mark.repo_files("pyproject.toml", "mkdocs.yml")
def test_the_package_description_names_every_level():
    import ampkit

    span = f"O0-{list(ampkit.OPT_LEVELS)[-1]}"
    assert f"(opt levels {span})" in (REPO / "pyproject.toml").read_text()
    assert f"(opt levels {span})" in (REPO / "mkdocs.yml").read_text()


VAGUE_VERSION = re.compile(r"earlier versions?|before this version|(?<![\w#/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}(?![\w/.-])")


def test_compatibility_notes_name_a_version_not_a_commit():
    """A guide says which version a checkpoint or pickle came from (``0.2.0``, a ``0.3.0`` development
    build), as the CHANGELOG does, never "an earlier version" or a commit hash."""
    pages = [*sorted((REPO / "docs").glob("*.md")), REPO / "docs" / "benchmarks" / "index.md",
             *sorted((REPO / "docs" / "design").glob("*.md")), REPO / "CHANGELOG.md", REPO / "README.md"]
    found = {p.relative_to(REPO).as_posix(): VAGUE_VERSION.findall(p.read_text()) for p in pages}
    assert {k: v for k, v in found.items() if v} == {}
    assert VAGUE_VERSION.findall("saved by an earlier version; fixed in 60f8d0a; colour #3f51b5; 0.2.0") == [
        "earlier version", "60f8d0a"]


@pytest.mark.repo_files("CHANGELOG.md")
def test_the_changelog_has_the_current_version():
    import ampkit

    assert f"## {ampkit.__version__}" in (REPO / "CHANGELOG.md").read_text()
