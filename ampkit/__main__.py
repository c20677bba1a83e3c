"""``python -m ampkit demo`` / ``python -m ampkit levels``."""
import sys

from ._cli.cli import main

if __name__ == "__main__":
    sys.exit(main())
