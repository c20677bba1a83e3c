"""griffe extension (``mkdocs.yml``): what ampkit builds at import time, read from the one module that builds it.

``initialize``'s signature and docstring come from ``ampkit/_config/options.py`` when
``ampkit/_initialize/initialize.py`` is imported; that module alone is imported here (it needs torch,
which ``ampkit[docs]`` installs). The rest of the package is read statically, so the API pages build
without the frameworks that ``ampkit.integrations`` imports (lightning, accelerate, transformers).
"""
import griffe

DYNAMIC = {"ampkit._initialize.initialize": ("initialize",)}  # module -> functions whose docs it builds


class DynamicDocstrings(griffe.Extension):
    """Replace the statically read signature and docstring of each function in ``DYNAMIC`` with the imported one."""

    def on_package(self, *, pkg, loader, **kwargs) -> None:
        if pkg.name != "ampkit":
            return
        for module, names in DYNAMIC.items():
            live = griffe.inspect(module, docstring_parser=loader.docstring_parser,
                                  docstring_options=loader.docstring_options)
            for name in names:
                static, built = pkg[f"{module.partition('.')[2]}.{name}"], live[name]
                static.parameters = built.parameters
                static.docstring = griffe.Docstring(built.docstring.value, parent=static, parser=loader.docstring_parser,
                                                    parser_options=loader.docstring_options)
