"""Kernel families whose candidates kill their process, as a crashing compiler or kernel would,
for one candidate (the second seed configuration): for the fault tests of the builder's and the
measure worker's processes. They generate the elementwise family's kernels."""
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


class OutOfBounds(SegfaultInBuild):
    """The crashing candidate's kernel stores far past its output: the interpreter, which runs the
    kernel's body in the process, dies of it (SIGSEGV), as a CUDA kernel faults the device."""
    name = "test_out_of_bounds_store"

    def generate(self, spec, config):
        program = ElementwiseFamily.generate(self, spec, config)
        if not self.crashes(spec, config):
            return program
        store = "tl.store(out0_ptr + idx, y, mask=mask)"
        assert store in program.source
        return dataclasses.replace(program, source=program.source.replace(store, store.replace("idx", "idx + (1 << 40)")))


class Hang(SegfaultInBuild):
    """The crashing candidate's kernel never returns (it passes the static source check)."""
    name = "test_hang"

    def generate(self, spec, config):
        program = ElementwiseFamily.generate(self, spec, config)
        if not self.crashes(spec, config):
            return program
        start = "    pid = tl.program_id(0)\n"
        assert start in program.source
        spin = start + "    spin = 0\n    while spin >= 0:\n        spin = spin + 1\n"
        return dataclasses.replace(program, source=program.source.replace(start, spin, 1))


BUILD = SegfaultInBuild()
MEASURE = SegfaultInMeasure()
OUT_OF_BOUNDS = OutOfBounds()
HANG = Hang()
