"""A kernel family whose code generation kills its process for one candidate (the second seed
configuration) with SIGSEGV, as a crashing compiler would: for the builder's fault tests. It
generates the elementwise family's kernels otherwise."""
from __future__ import annotations

import multiprocessing
import os
import signal

from torch_kernelize.lowering.kernels.elementwise import ElementwiseFamily


class SegfaultingFamily(ElementwiseFamily):
    name = "test_segfaulting_elementwise"

    def crashes(self, spec, config) -> bool:
        return config.key == self.seed_configs(spec)[1].key

    def generate(self, spec, config):
        if self.crashes(spec, config) and multiprocessing.parent_process() is not None:  # never the test's own
            os.kill(os.getpid(), signal.SIGSEGV)
        return super().generate(spec, config)


FAMILY = SegfaultingFamily()
