"""Every ``python`` code block of README.md and docs/ runs, so a block that no longer works fails the suite.

Each block runs in a fresh namespace holding what the pages assume is at hand: a small ``model``
and its ``optimizer`` (not yet initialized), a ``loader`` of three batches, ``loss_fn(output,
target)``, ``make_model_and_optimizer()`` (another such pair) and ``tmp_path``. Markers before a
block (see ``blocks.py``) continue the previous block's namespace, mark it slow, or skip it with
the reason and the test that covers it elsewhere.
"""
import copy
import gc
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from .blocks import REPO, Block, python_blocks

# The torch.compile page's block compiles an optimizer step, which imports torch.utils.mkldnn, whose
# bodies use torch.jit.script_method: torch's own deprecation, not ampkit's.
pytestmark = [pytest.mark.repo_files("README.md", "docs"),
              pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")]
BLOCKS = python_blocks() if (REPO / "docs").exists() else []


def make_model_and_optimizer():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def namespace(tmp_path) -> dict:
    torch.manual_seed(0)
    model, optimizer = make_model_and_optimizer()
    return {
        "__name__": "docs_block", "torch": torch, "nn": nn, "F": F, "ampkit": ampkit, "copy": copy,
        "model": model, "optimizer": optimizer, "loss_fn": F.mse_loss, "tmp_path": tmp_path,
        "loader": [(torch.randn(4, 8), torch.randn(4, 4)) for _ in range(3)],
        "make_model_and_optimizer": make_model_and_optimizer,
    }


_namespaces = {}  # page -> the namespace its last block left (for "continue")
_made = []  # every namespace a block ran in, emptied when this module ends


@pytest.fixture(autouse=True, scope="module")
def _forget_namespaces():
    """The blocks' models, optimizers and runs die with this module: a run kept alive here would
    be another live training run for every later test (the current run, its warnings). A
    function that Dynamo compiled keeps its globals (the namespace) alive, so each namespace is
    emptied, not just forgotten."""
    yield
    torch._dynamo.reset()
    for ns in _made:  # the names the pages use; dunders stay (Dynamo keeps its builtins there)
        for name in [n for n in ns if not n.startswith("__")]:
            del ns[name]
    _made.clear()
    _namespaces.clear()
    gc.collect()


def _param(block):
    marks = [pytest.mark.slow] if block.kind == "slow" else []
    return pytest.param(block, id=block.id, marks=marks)


def run_block(block, tmp_path) -> None:
    if block.kind == "continue":
        assert block.path in _namespaces, f"{block.id}: 'continue' needs a block before it on the page"
        ns = _namespaces[block.path]
    else:
        ns = namespace(tmp_path)
        _made.append(ns)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ampkit.NoEffectWarning)
        exec(compile(block.code, block.id, "exec"), ns)
    _namespaces[block.path] = ns


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_block_runs(block, tmp_path):
    if block.kind == "skip":
        pytest.skip(block.reason)
    run_block(block, tmp_path)


def test_the_pages_have_code_blocks():
    pages = {b.path.relative_to(REPO).as_posix() for b in BLOCKS}
    assert {"README.md", "docs/index.md", "docs/getting-started.md", "docs/training-loops.md"} <= pages


def test_every_skipped_block_names_a_test_that_exists():
    for block in (b for b in BLOCKS if b.kind == "skip"):
        covered = block.covered_by()
        if covered is None:
            assert "not covered" in block.reason, f"{block.id}: a skipped block names the test that covers it"
            continue
        path, name = covered
        assert f"def {name}(" in (REPO / path).read_text(), f"{block.id}: {path}::{name} does not exist"


def test_a_broken_block_fails(tmp_path):
    """The runner itself: a block that raises fails its test, and names itself in the traceback."""
    bad = Block(REPO / "docs" / "index.md", 1, "python", "x = 1\nampkit.initialize(model, optimizer, opt_level='O9')", None)
    with pytest.raises(ValueError, match="unknown opt level") as info:
        run_block(bad, tmp_path)
    assert any(str(entry.path) == "docs/index.md:1" for entry in info.traceback)
