import sys

from torch_kernelize.fill_cache.cli import main

# The guard matters: the CUDA builder's worker processes are spawned, and spawning re-imports
# the main module; without it every worker would start a fill_cache run of its own.
if __name__ == "__main__":
    sys.exit(main())
