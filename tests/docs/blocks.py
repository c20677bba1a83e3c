"""The fenced code blocks of README.md and docs/, with the test marker written before each.

A marker is an HTML comment on the last non-blank line before the fence (invisible on the page):

* ``<!-- test: continue -->``: run in the namespace the previous block of the page left;
* ``<!-- test: slow; reason -->``: run, marked slow;
* ``<!-- test: skip; reason; covered by tests/x.py::test_name -->``: not run here (CUDA, several
  processes); the named test must exist. Without "covered by" the reason must say why nothing can.
"""
import dataclasses
import re
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")
MARKER = re.compile(r"^\s*<!-- test: (?P<kind>continue|slow|skip)(?:; (?P<rest>.*?))? -->\s*$")
COVERED = re.compile(r"covered by (?P<path>tests/[\w/]+\.py)::(?P<test>\w+)")


@dataclasses.dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    kind: Optional[str]  # None, "continue", "slow", "skip"
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    def covered_by(self):
        """``(path, test name)`` named by a skip marker, or None."""
        m = COVERED.search(self.reason)
        return (m["path"], m["test"]) if m else None


def markdown_files() -> List[Path]:
    return [REPO / "README.md"] + sorted((REPO / "docs").rglob("*.md"))


def blocks(path: Path) -> List[Block]:
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or not m["lang"]:
            i += 1
            continue
        indent, start = m["indent"], i
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```" and lines[j].startswith(indent))
        code = "\n".join(line[len(indent):] for line in lines[start + 1:end])
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(before)
        out.append(Block(path, start + 1, m["lang"], code, marker["kind"] if marker else None,
                         (marker["rest"] or "") if marker else ""))
        i = end + 1
    return out


def python_blocks() -> List[Block]:
    return [b for path in markdown_files() for b in blocks(path) if b.lang == "python"]
