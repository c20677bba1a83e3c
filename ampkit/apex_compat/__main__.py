"""``python -m ampkit.apex_compat [--shadow-apex] train.py ARGS...`` (or ``-m module ARGS...``):
run an unmodified Apex-era script with ampkit standing in for ``apex``.

Under torchrun, put the runner in front of the script so every worker gets it:
``torchrun --nproc-per-node 2 -m ampkit.apex_compat train.py ARGS...``.
"""
import os
import runpy
import sys

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
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(argv[0], run_name="__main__")
    _destroy_process_group()
    return 0


def _destroy_process_group() -> None:
    """Destroy the default process group a finished script left initialized (Apex's examples
    never destroyed theirs), as torch asks every program to, so that it is not torn down only
    at interpreter exit."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
