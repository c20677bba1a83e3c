"""The API reference documents the public face only: every ``:::`` entry and every heading on the API
pages is a public import path (``ampkit.initialize``, ``ampkit.checkpoint.save``), a module's members
are its ``__all__``, no dunder or private member shows, and no Sphinx role (``:func:``) is left raw in a
page or a public docstring (the site renders Markdown docstrings)."""
import importlib
import importlib.util
import inspect
import re

import pytest

from tests.test_public_api import NEEDS, PUBLIC
from .blocks import REPO, markdown_files

pytestmark = pytest.mark.repo_files("docs", "mkdocs.yml")

ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|obj|exc|ref|py:\w+):`[~!\w.]")
ENTRY = re.compile(r"^:::\s*(\S+)(?P<options>(?:\n[ \t]+.*)*)", re.M)
MEMBERS = re.compile(r"^\s+members:\s*\[([^\]]*)\]", re.M)
BUILTIN_DOCS = ("str(object=", "int([x])", "int(x=0)", "dict() -> new empty dictionary", "Built-in mutable sequence")


def public_path_problem(path: str):
    """Why ``path`` is not a public import path, or None: the longest public module it starts with, then a
    name of that module's ``__all__``, then (methods, attributes) names without a leading underscore."""
    if any(m.startswith(path + ".") for m in PUBLIC if m != "ampkit"):
        return None  # a package of public modules (ampkit.integrations)
    module = max((m for m in PUBLIC if path == m or path.startswith(m + ".")), key=len, default=None)
    if module is None:
        return f"{path}: not under a public module"
    rest = path[len(module) + 1:].split(".") if path != module else []
    if rest and rest[0] not in PUBLIC[module]:
        return f"{path}: {rest[0]} is not in {module}.__all__"
    if any(part.startswith("_") for part in rest[1:]):
        return f"{path}: a private member or a dunder"
    return None


def page_problems(text: str) -> list:
    """What a Markdown page of the site gets wrong about the public face."""
    out = [f"raw Sphinx role: {m[0]}" for m in ROLE.finditer(text)]
    for m in ENTRY.finditer(text):
        problem = public_path_problem(m[1])
        if problem:
            out.append(f"::: {problem}")
        for listed in MEMBERS.findall(m["options"]):
            names = [n.strip() for n in listed.split(",") if n.strip()]
            out += [f"::: {m[1]}: member {n} is not in its __all__" for n in names
                    if public_path_problem(f"{m[1]}.{n}") or n.startswith("__")]
    return out


def test_the_check_sees_a_private_path_an_outside_member_a_dunder_and_a_raw_role():
    bad = ("::: ampkit._loop.checkpoint\n\n::: ampkit.checkpoint\n    options:\n      members: [save, fsync_dir]\n\n"
           "::: ampkit.checkpoint.__doc__\n\nRestore the scalers from :func:`state_dict` output.\n")
    assert page_problems(bad) == [
        "raw Sphinx role: :func:`s",
        "::: ampkit._loop.checkpoint: _loop is not in ampkit.__all__",
        "::: ampkit.checkpoint: member fsync_dir is not in its __all__",
        "::: ampkit.checkpoint.__doc__: __doc__ is not in ampkit.checkpoint.__all__",
    ]
    assert page_problems("::: ampkit.checkpoint\n    options:\n      members: [save, load]\n") == []
    assert public_path_problem("ampkit.fp16_utils.FP16_Optimizer._master") is not None


def generated(page) -> str:
    """The page as mkdocs sees it: the hook's markers replaced by the entries they stand for."""
    if importlib.util.find_spec("mkdocs") is None:
        return page.read_text()
    spec = importlib.util.spec_from_file_location("ampkit_docs_generated", REPO / "docs" / "hooks" / "generated.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook.on_page_markdown(page.read_text(), page=None, config=None, files=None)


@pytest.mark.parametrize("page", [p for p in markdown_files() if "docs" in p.parts], ids=lambda p: p.name)
def test_no_page_documents_a_private_path_or_leaves_a_role_raw(page):
    text = generated(page) if page.parent.name == "api" else page.read_text()
    assert page_problems(text) == []


def test_every_public_module_has_an_entry_with_its_whole_all():
    entries = "\n".join(generated(p) for p in sorted((REPO / "docs" / "api").glob("*.md")))
    for module, names in PUBLIC.items():
        if module == "ampkit":
            documented = re.findall(r"^::: ampkit\.(\w+)$", generated(REPO / "docs" / "api" / "index.md"), re.M)
            assert set(documented) == {n for n in names if not inspect.ismodule(getattr(importlib.import_module("ampkit"), n))
                                       and n != "__version__"}
            continue
        m = re.search(rf"^::: {re.escape(module)}\n(?:[ \t]+.*\n)*?\s+members: \[([^\]]*)\]", entries, re.M)
        assert m, f"no API entry for {module}"
        assert [n.strip() for n in m[1].split(",")] == names, module


def test_no_public_docstring_has_a_raw_role():
    from .test_site import public_objects

    docs = {name: inspect.getdoc(obj) or "" for name, obj in public_objects()
            if getattr(obj, "__module__", "").startswith("ampkit")}  # not torch's clip_grad_norm_, re-exported
    for module in set(PUBLIC) - set(NEEDS):
        docs[module] = importlib.import_module(module).__doc__ or ""
    assert {name: ROLE.findall(doc) for name, doc in docs.items() if ROLE.search(doc)} == {}
