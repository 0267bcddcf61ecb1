"""Kernel cache commands from a checkout: python tools/cache.py {list,show,check,verify,export,import,trust,gc}.

The same command as ``python -m torch_kernelize.cache`` (the ``kernelize-cache`` script), which is
installed with the package: see torch_kernelize/cache.py.
"""
import sys

from torch_kernelize.cache import main

if __name__ == "__main__":
    sys.exit(main())
