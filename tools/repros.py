"""Reproducers from a checkout: python tools/repros.py {list,replay} DIR [...] | task REPRO_FOLDER.

The implementation is installed with the package (torch_kernelize.repro.listing) so that a
production machine without this checkout can replay repros too.
"""
import sys

from torch_kernelize.repro.listing import main

if __name__ == "__main__":
    sys.exit(main())
