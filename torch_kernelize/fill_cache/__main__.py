import sys

from torch_kernelize.fill_cache.cli import main

sys.exit(main())
