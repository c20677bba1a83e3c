"""``python -m ampkit.apex_compat [--shadow-apex] train.py ARGS...`` (or ``-m module ARGS...``):
run an unmodified Apex-era script with ampkit standing in for ``apex``.

Under torchrun, put the runner in front of the script so every worker gets it:
``torchrun --nproc-per-node 2 -m ampkit.apex_compat train.py ARGS...``.
"""
import atexit
import gc
import importlib.util
import os
import runpy
import sys
import types

from . import ENV, ApexInstalledError, install

USAGE = ("usage: python -m ampkit.apex_compat [--shadow-apex] SCRIPT.py [ARGS...]\n"
         "       python -m ampkit.apex_compat [--shadow-apex] -m MODULE [ARGS...]\n"
         "Runs SCRIPT (or MODULE) with `import apex` resolving to ampkit in that process only.\n"
         f"--shadow-apex: stand in even where a real Apex is installed (also: {ENV}=ampkit).")


def main(argv) -> int:
    shadow = None
    while argv and argv[0].startswith("-") and argv[0] != "-m":
        opt = argv.pop(0)
        if opt in ("-h", "--help"):
            print(USAGE)
            return 0
        if opt == "--shadow-apex":
            shadow = True
        else:
            print(f"python -m ampkit.apex_compat: unknown option {opt!r}\n{USAGE}", file=sys.stderr)
            return 2
    module = None
    if argv and argv[0] == "-m":
        if len(argv) < 2:
            print(f"python -m ampkit.apex_compat: -m needs a module name\n{USAGE}", file=sys.stderr)
            return 2
        module = argv[1]
        argv = argv[1:]
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    if module is None:
        if not os.path.isfile(argv[0]):
            print(f"python -m ampkit.apex_compat: no such script {argv[0]!r}", file=sys.stderr)
            return 2
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python script.py` would, before looking for apex
    try:
        install(shadow)
    except ApexInstalledError as e:
        print(f"python -m ampkit.apex_compat: {e}", file=sys.stderr)
        return 2
    sys.argv = list(argv)
    if module is not None:
        missing = module_error(module)
        if missing is not None:
            print(f"{sys.executable}: {missing}", file=sys.stderr)  # Python's own line for `python -m`
            return 1
        atexit.register(_release, {})  # registered before the script's handlers, so it runs after them
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        module = types.ModuleType("__main__")
        atexit.register(_release, module.__dict__)
        run_script(argv[0], module)
    return 0


def module_error(name: str):
    """What ``python -m name`` says when it cannot find ``name`` (None when it can)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        return f"Error while finding module specification for {name!r} ({type(e).__name__}: {e})"
    if spec is None:
        return f"No module named {name}"
    if spec.submodule_search_locations is not None and module_error(name + ".__main__") is not None:
        return f"No module named {name}.__main__; {name!r} is a package and cannot be directly executed"
    return None


def run_script(path: str, module: types.ModuleType) -> None:
    """Run the script at ``path`` in ``module`` as ``__main__``, as ``runpy.run_path`` does for a
    file, but in a module the runner keeps (runpy hands back a copy of its namespace). Its
    ``__file__`` is absolute, as ``python script.py`` gives it since Python 3.9."""
    path = os.path.abspath(path)
    module.__file__ = path
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)
    finally:
        sys.modules["__main__"] = saved


def _release(namespace: dict) -> None:
    """At exit, after the script's own atexit handlers: drop the script's objects and destroy
    the process group it left initialized (Apex's examples never destroyed theirs), while the
    interpreter is whole. A group that is only torn down in interpreter finalization, with
    gloo's threads still holding tensors that Python owns, can abort the process
    ("terminate called without an active exception"; pytorch/pytorch#190489); a DDP model in
    the script's globals keeps it alive past ``destroy_process_group`` alone."""
    namespace.clear()
    gc.collect()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
