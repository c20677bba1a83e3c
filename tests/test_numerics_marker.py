"""The ``numerics`` marker (tests/conftest.py): every listed path exists, and it marks what it lists."""
from types import SimpleNamespace

import pytest
from conftest import NUMERICS, REPO, pytest_collection_modifyitems


@pytest.mark.parametrize("entry", NUMERICS)
def test_every_numerics_entry_exists(entry):
    path, _, test = entry.partition("::")
    assert (REPO / "tests" / path).exists(), f"tests/conftest.py NUMERICS lists {path!r}, which is not there"
    if test:
        assert f"def {test}(" in (REPO / "tests" / path).read_text(), f"{path} has no test {test!r} (NUMERICS)"


def _marked(path, test="test_x[O1]"):
    item = SimpleNamespace(path=path, nodeid=f"{path.name}::{test}", markers=[])
    item.add_marker = item.markers.append
    pytest_collection_modifyitems(None, [item])
    return [m.name for m in item.markers]


def test_marks_the_listed_paths_and_nothing_else():
    tests = REPO / "tests"
    assert _marked(tests / "normalization" / "test_layer_norm.py") == ["numerics"]  # in a listed folder
    assert _marked(tests / "loop" / "test_compile.py") == ["numerics"]  # a listed module
    assert _marked(tests / "loop" / "test_compile_more.py") == []  # a prefix of a name is not a match
    assert _marked(tests / "cli" / "test_cli.py") == []
    assert _marked(REPO / "examples" / "test_x.py") == []  # outside tests/
    module = tests / "initialize" / "test_initialize.py"
    assert _marked(module, "test_training_reduces_loss[O1-cpu]") == ["numerics"]  # a listed test
    assert _marked(module, "test_training_reduces_loss_more") == [] and _marked(module, "test_other") == []


def test_marker_is_registered(pytestconfig):
    assert any(line.startswith("numerics:") for line in pytestconfig.getini("markers"))
