"""List reproducers, replay them, or write one up as a task: the command line of
torch_kernelize/repro/listing.py.

    python -m torch_kernelize.repros list   kernelize_repros
    python -m torch_kernelize.repros replay kernelize_repros [--target T] [--cache-dir D] [--jobs N] [--run-scripts]
    python -m torch_kernelize.repros task   kernelize_repros/<folder>   # task.md + check_candidate.py

Also installed as the ``kernelize-repros`` script; in a checkout, ``python tools/repros.py`` is the
same command. Exit codes: listing.py's.
"""
import sys

from torch_kernelize.repro.listing import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
