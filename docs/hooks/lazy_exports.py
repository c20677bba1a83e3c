"""griffe extension (``mkdocs.yml``): the names ``ampkit`` imports on first use, as members of ``ampkit``.

``ampkit/__init__.py`` imports its public names lazily from the ``_EXPORTS`` table (name -> the private
module that defines it), which a static reader cannot follow. Each of them becomes an alias on the
``ampkit`` package here, so ``::: ampkit.initialize`` documents it under its public path and
``[ampkit.initialize][]`` links to it.
"""
import ast
from pathlib import Path

import griffe

INIT = Path(__file__).resolve().parents[2] / "ampkit" / "__init__.py"


def public_exports() -> dict:
    """``ampkit.__all__``'s names -> defining module ("" for a submodule), read from ``ampkit/__init__.py``."""
    for node in ast.parse(INIT.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "_EXPORTS":
            return {k: v for k, v in ast.literal_eval(node.value).items() if not k.startswith("_")}
    raise RuntimeError(f"{INIT} has no _EXPORTS table")


class LazyExports(griffe.Extension):
    def on_package(self, *, pkg, **kwargs) -> None:
        if pkg.name != "ampkit":
            return
        for name, module in public_exports().items():
            if module:  # "" is a public submodule, which griffe finds itself
                pkg.set_member(name, griffe.Alias(name, f"ampkit.{module}.{name}", parent=pkg))
