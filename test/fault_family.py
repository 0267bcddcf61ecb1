"""Kernel families whose candidates kill their process with SIGSEGV, as a crashing compiler or
kernel would, for one candidate (the second seed configuration): for the fault tests of the
builder's and the measure worker's processes. They generate the elementwise family's kernels."""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal

from torch_kernelize.lowering.kernels.elementwise import ElementwiseFamily

SEGFAULT = "\nimport os, signal\nos.kill(os.getpid(), signal.SIGSEGV)  # fault_family: this candidate crashes\n"


class SegfaultInBuild(ElementwiseFamily):
    """Code generation of the crashing candidate kills the builder's worker."""
    name = "test_segfault_in_build"

    def crashes(self, spec, config) -> bool:
        return config.key == self.seed_configs(spec)[1].key

    def generate(self, spec, config):
        if self.crashes(spec, config) and multiprocessing.parent_process() is not None:  # never the test's own
            os.kill(os.getpid(), signal.SIGSEGV)
        return super().generate(spec, config)


class SegfaultInMeasure(SegfaultInBuild):
    """The crashing candidate's program kills the process that loads it: the measure worker."""
    name = "test_segfault_in_measure"

    def generate(self, spec, config):
        program = ElementwiseFamily.generate(self, spec, config)
        return dataclasses.replace(program, source=program.source + SEGFAULT) if self.crashes(spec, config) else program


BUILD = SegfaultInBuild()
MEASURE = SegfaultInMeasure()
