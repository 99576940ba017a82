"""``python -m pathways`` and the ``pathways`` script: the command line of :mod:`pathways.cli`."""

import sys

from pathways.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
