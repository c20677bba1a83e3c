"""The benchmarks' own helpers import each other as top-level modules (``benchmarks/run.py`` runs with
``benchmarks/`` on the path): the tests here import them the same way."""
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
