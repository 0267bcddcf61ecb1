"""core/sized_programs.py: a bucket's program at any of its sizes through one generated sizing
function, the same function on symbols for a call generated once, and what it refuses."""
from __future__ import annotations

import pytest

from torch_kernelize.core.buckets import evaluate
from torch_kernelize.core.program import Buffer, KernelProgram, Launch, View
from torch_kernelize.core.sized_programs import SIZES, Resizer, SizeSource, cdiv, size_source, source_strides

SOURCE = "import triton\n@triton.jit\ndef k(x, y, n, XBLOCK: tl.constexpr):\n    pass\n"
GRID = ["cdiv", ["mul", 128, "v0"], 256]
ROWS = ["add", ["mul", 2, "v0", "v0"], 3]


def _program() -> KernelProgram:
    """A launch whose grid and one scalar vary, a buffer and a view whose size and offset vary."""
    launch = Launch("k", (1, 1, 1), (("tmp", 0), ("view", 0), ("i32", 0)), {"XBLOCK": 256}, 4, 1,
                    runtime_sizes={"grid": [GRID, 1, 1], "args": {"2": ROWS}})
    return KernelProgram(SOURCE, (launch,), temps=(Buffer((64,), "float32"),), views=(View(("tmp", 0), 8),),
                         sized=((("temps", 0, "shape", 0), ["mul", 64, "v0"]), (("views", 0, 2), ["mul", 8, "v0"])))


def test_each_size_gets_the_integers_its_expressions_give_and_nothing_else_changes():
    program, resize = _program(), Resizer(_program())
    for s in (1, 5, 33):
        got = resize((s,))
        (launch,) = got.launches
        assert launch.grid == (evaluate(GRID, (s,)), 1, 1) and launch.args[2] == ("i32", evaluate(ROWS, (s,)))
        assert got.temps[0].shape == (64 * s,) and got.views[0].offset == 8 * s and got.sized == ()
        assert launch.args[:2] == program.launches[0].args[:2] and launch.constexprs == {"XBLOCK": 256}
    assert program == _program()  # (the base program stays as it was)


def test_the_same_function_on_symbols_writes_each_integer_as_source_of_the_sizes():
    sym = Resizer(_program()).symbolic()
    (launch,) = sym.launches
    for s in (1, 7, 40):
        at = {"v": (s,), "cdiv": cdiv}
        assert eval(launch.grid[0], at) == evaluate(GRID, (s,)) and eval(launch.args[2][1], at) == evaluate(ROWS, (s,))
        assert eval(sym.temps[0].shape[0], at) == 64 * s and eval(sym.views[0].offset, at) == 8 * s
    assert 1 * SIZES[0] is not None and SIZES[0] * 1 == "v[0]" and 0 + SIZES[0] == "v[0]" and SIZES[0] * 0 == 0
    assert source_strides((2, SIZES[0], 4)) == (SizeSource("(4 * v[0])"), 4, 1) and source_strides((3, 0)) == (1, 1)


def test_what_is_no_size_expression_is_refused_and_never_runs():
    for bad in ("__import__('os')", ["pow", "v0", 2], True, ["cdiv", "v0"], "v²"):
        with pytest.raises(ValueError, match="bad size expression"):
            size_source(bad)
    with pytest.raises(ValueError, match="divides by 0"):
        cdiv(3, 0)
    program = _program()
    for path, match in ((("launches", 0, "grid", 0), "not in a buffer, step or view"),
                        (("temps", 0), "names no integer"),
                        (("temps", 0, "stride", 0), "not in the program")):
        sized = ((path, 2),)
        with pytest.raises(ValueError, match=match):
            Resizer(KernelProgram(program.source, program.launches, temps=program.temps, views=program.views,
                                  sized=sized))


def test_a_size_that_breaks_the_program_is_refused_with_the_size():
    program = _program()
    shrinking = KernelProgram(program.source, program.launches, temps=program.temps, views=program.views,
                              sized=((("temps", 0, "shape", 0), ["mul", 4, "v0"]), (("views", 0, 2), ["mul", 8, "v0"])))
    with pytest.raises(ValueError, match=r"at sizes \(3,\): outside its buffer"):
        Resizer(shrinking)((3,))
    zero_grid = Launch("k", (1,), (("tmp", 0), ("tmp", 0), ("i32", 0)), {"XBLOCK": 256}, 4, 1,
                       runtime_sizes={"grid": [["add", "v0", -3]]})
    with pytest.raises(ValueError, match=r"bad grid \(0,\) at sizes \(3,\)"):
        Resizer(KernelProgram(program.source, (zero_grid,), temps=program.temps))((3,))
