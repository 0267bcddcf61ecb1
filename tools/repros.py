"""Reproducers from a checkout: python tools/repros.py {list,replay} DIR [...] | task REPRO_FOLDER.

The same command as ``python -m torch_kernelize.repros`` (the ``kernelize-repros`` script), which
is installed with the package so that a production machine without this checkout can replay
repros too: see torch_kernelize/repro/listing.py.
"""
import sys

from torch_kernelize.repros import main

if __name__ == "__main__":
    sys.exit(main())
