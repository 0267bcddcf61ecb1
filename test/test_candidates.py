"""Candidate files (fill_cache --candidate): the recorder, the harness's verdicts on deliberately
broken candidates (one per known way of cheating a harness), the task writer, and the path from a
candidate file to the kernel the backend serves."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import REPO, write_target
from torch_kernelize import flush_repros
from torch_kernelize.fill_cache.collect import UsageError
from torch_kernelize.fill_cache.external import Candidate, CandidateGenerator, with_candidates
from torch_kernelize.fill_cache.measure import Measurer
from torch_kernelize.lowering.kernels import family_for
from torch_kernelize.lowering.kernels.recording import RecordingError
from torch_kernelize.core.targets import get_target
from torch_kernelize.core.spec import KernelSpec

CANDIDATES = REPO / "test" / "candidates"
EXAMPLE = REPO / "examples" / "logcumsumexp_candidate.py"
aten = torch.ops.aten


def sigmoid_spec(shape=(8, 32)) -> KernelSpec:
    x = torch.randn(shape)
    return KernelSpec.from_call(aten.sigmoid.default, [x], {}, torch.sigmoid(x))


def evaluate(path: Path, spec: KernelSpec, captured=None):
    """The candidate's evaluation as fill_cache makes it (its generator beside the spec's family)."""
    candidate = Candidate(path)
    measurer = Measurer(spec, CandidateGenerator([candidate], family_for(spec)), get_target("interpreter"),
                        [captured] if captured is not None else [])
    try:
        return measurer.evaluate(candidate.config)
    finally:
        measurer.builder.close()


def write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def test_a_correct_candidate_is_accepted_and_recorded_as_one_launch():
    spec = sigmoid_spec()
    ev = evaluate(CANDIDATES / "sigmoid_ok.py", spec)
    assert ev.correct, ev.error
    assert ev.validation["kinds"][-1] == "special" and ev.validation["trials"] >= 7
    candidate = Candidate(CANDIDATES / "sigmoid_ok.py")
    program = CandidateGenerator([candidate], None).generate(spec, candidate.config)
    (launch,) = program.launches
    assert launch.kernel == "sigmoid_kernel" and launch.grid == (1,)
    assert launch.args == (("in", 0), ("out", 0), ("i32", 256)) and launch.constexprs == {"BLOCK": 256}
    assert not program.temps  # its source: the recorded kernel and the imports it needs, nothing else
    assert program.source.startswith("import triton\nimport triton.language as tl\n\n@triton.jit\ndef sigmoid_kernel(")
    assert "def launch" not in program.source and "OP =" not in program.source and "import torch" not in program.source


def test_intermediate_buffers_and_several_launches_are_recorded():
    x = torch.randn(6, 100)
    spec = KernelSpec.from_call(aten.sum.dim_IntList, [x, [-1]], {}, x.sum(-1))
    candidate = Candidate(CANDIDATES / "sum_two_pass.py")
    program = CandidateGenerator([candidate], None).generate(spec, candidate.config)
    assert [l.kernel for l in program.launches] == ["partial_sums", "sum_partials"]
    assert [b.to_json() for b in program.temps] == [{"shape": [24], "dtype": "float32", "init": 0}]
    assert program.launches[0].args == (("in", 0), ("tmp", 0), ("i32", 100))
    assert program.launches[1].args == (("tmp", 0), ("out", 0)) and program.launches[1].num_warps == 1
    ev = evaluate(CANDIDATES / "sum_two_pass.py", spec)
    assert ev.correct, ev.error


def test_recorded_programs_compile_for_sm90(tmp_path):
    """What serving on the GPU loads: one cubin per recorded launch, compiled here (no GPU)."""
    from torch_kernelize.building.programs import write_program
    x = torch.randn(6, 100)
    spec = KernelSpec.from_call(aten.sum.dim_IntList, [x, [-1]], {}, x.sum(-1))
    candidate = Candidate(CANDIDATES / "sum_two_pass.py")
    program = CandidateGenerator([candidate], None).generate(spec, candidate.config)
    files = write_program(tmp_path, spec, program, "cuda", ("cuda", 90, 32))
    assert {"launch0.cubin", "launch1.cubin"} <= set(files)
    assert (tmp_path / "kernel.py").read_text() == program.source


@pytest.mark.parametrize("name, where, expected", [
    ("sigmoid_writes_input.py", "validation", "the kernel wrote to its input 0 at index (0, 0)"),
    ("sigmoid_returns_input.py", "recording", "output 0 is input 0"),
    ("sigmoid_cached_output.py", "recording", "kept from import time or an earlier call"),
    ("sigmoid_side_stream.py", "recording", "used torch.cuda.Stream"),
    ("sigmoid_low_precision.py", "validation", "out of tolerance"),
    ("sigmoid_reads_output.py", "validation", "output 0 depends on what its buffer held before the run"),
    ("sigmoid_guesses_poison.py", "validation", "output 0 depends on what its buffer held before the run"),
    ("sigmoid_host_compute.py", "recording", "ran aten.sigmoid.default on the host"),
])
def test_a_cheating_candidate_is_rejected_with_the_first_failing_trial(name, where, expected):
    ev = evaluate(CANDIDATES / name, sigmoid_spec())
    assert not ev.correct and expected in ev.error, ev.error
    if where == "validation":  # the first failing trial: its number, kind and seed
        assert ev.error.startswith("trial 1 (random, seed 0)"), ev.error
    else:
        assert ev.error.startswith("build failed:") and f"RecordingError: {name}" in ev.error, ev.error


def test_the_precision_cheat_reports_max_error_and_where():
    ev = evaluate(CANDIDATES / "sigmoid_low_precision.py", sigmoid_spec())
    assert "max error" in ev.error and "first at index (" in ev.error, ev.error


def test_a_candidate_correct_only_on_the_captured_inputs_is_rejected(tmp_path):
    # The captured inputs are small (|x| < 0.05); a cubic Taylor polynomial of sigmoid is exact to
    # 1e-9 there, and wrong by far more than fp32's tolerance on the inputs the harness draws.
    captured = [torch.rand(8, 32) * 0.1 - 0.05]
    path = write(tmp_path, "taylor.py", '''
        import torch, triton, triton.language as tl
        OP = "aten.sigmoid.default"

        @triton.jit
        def taylor(x, out, n, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            v = tl.load(x + offs, mask=offs < n)
            tl.store(out + offs, 0.5 + v / 4 - v * v * v / 48, mask=offs < n)

        def launch(x):
            out = torch.empty_like(x)
            taylor[(1,)](x, out, x.numel(), BLOCK=256)
            return out
    ''')
    spec = sigmoid_spec()
    candidate = Candidate(path)
    program = CandidateGenerator([candidate], None).generate(spec, candidate.config)
    from torch_kernelize.building.programs import write_program
    from torch_kernelize.serving.launch import load_program
    write_program(tmp_path / "built", spec, program, "interpreter")
    got = load_program(tmp_path / "built", spec, "interpreter")(*captured)
    torch.testing.assert_close(got, torch.sigmoid(captured[0]))  # it does pass on what was captured
    ev = evaluate(path, spec, captured)
    assert not ev.correct and ev.error.startswith("trial 1 (random, seed 0)"), ev.error


def test_launches_that_depend_on_input_values_are_rejected(tmp_path):
    item = write(tmp_path, "item.py", '''
        import torch, triton, triton.language as tl
        OP = "aten.sigmoid.default"

        @triton.jit
        def k(x, out, n, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(out + offs, tl.load(x + offs, mask=offs < n), mask=offs < n)

        def launch(x):
            out = torch.empty_like(x)
            if x[0, 0].item() > 100:   # a value read on the host
                return out
            k[(1,)](x, out, x.numel(), BLOCK=256)
            return out
    ''')
    numpy = write(tmp_path, "numpy_peek.py", item.read_text().replace(
        "if x[0, 0].item() > 100:   # a value read on the host\n        return out\n    ",
        "salt = int(abs(x.numpy().sum()) * 1e6)  # a value read past the dispatcher\n    ").replace(
        "BLOCK=256)", "BLOCK=256, SALT=salt)").replace("BLOCK: tl.constexpr)", "BLOCK: tl.constexpr, SALT: tl.constexpr)"))
    assert "numpy" in numpy.read_text()
    ev = evaluate(item, sigmoid_spec())
    assert not ev.correct and "read a tensor's value on the host" in ev.error, ev.error
    ev = evaluate(numpy, sigmoid_spec())
    assert not ev.correct and "different launches for two inputs" in ev.error, ev.error


def test_kernels_outside_the_file_and_foreign_tensors_are_refused(tmp_path):
    foreign = write(tmp_path, "foreign.py", '''
        import torch, triton, triton.language as tl
        OP = "aten.sigmoid.default"
        TABLE = torch.zeros(256)

        @triton.jit
        def k(x, table, out, n, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(out + offs, tl.load(table + offs), mask=offs < n)

        def launch(x):
            out = torch.empty_like(x)
            k[(1,)](x, TABLE, out, x.numel(), BLOCK=256)
            return out
    ''')
    ev = evaluate(foreign, sigmoid_spec())
    assert "neither received nor allocated" in ev.error, ev.error
    nested = write(tmp_path, "nested.py", '''
        import torch, triton, triton.language as tl
        OP = "aten.sigmoid.default"

        def launch(x):
            @triton.jit
            def inner(x, out, n, BLOCK: tl.constexpr):
                offs = tl.arange(0, BLOCK)
                tl.store(out + offs, tl.load(x + offs, mask=offs < n), mask=offs < n)
            out = torch.empty_like(x)
            inner[(1,)](x, out, x.numel(), BLOCK=256)
            return out
    ''')
    ev = evaluate(nested, sigmoid_spec())
    assert "defined at the top level of the candidate file" in ev.error, ev.error


def test_a_candidate_must_say_what_it_is_for_and_match_something(tmp_path):
    silent = write(tmp_path, "silent.py", "def launch(x):\n    return x\n")
    with pytest.raises(UsageError, match="say what it is for"):
        Candidate(silent)
    other = write(tmp_path, "other.py", "SPECS = ['0123']\ndef launch(x):\n    return x\n")
    from torch_kernelize.fill_cache.collect import Work
    with pytest.raises(UsageError, match="no reproducer or model given records"):
        with_candidates([other], [Work(sigmoid_spec(), "test")])
    with pytest.raises(UsageError, match="no such file"):
        with_candidates([tmp_path / "missing.py"], [])


def _repro(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A chip without aten.logcumsumexp, a model using it compiled once: (chip, repros, folder)."""
    from torch_kernelize.model_zoo import make_log_scan
    chip = write_target(tmp_path / "chip.toml", unsupported=["aten.logcumsumexp"])
    repros = tmp_path / "repros"
    model, inputs = make_log_scan()
    compiled = torch.compile(model, backend="kernelize", options={
        "target": str(chip), "cache_dir": str(tmp_path / "cache"), "repro_dir": str(repros)})
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs))
    flush_repros()  # misses are recorded in the background
    folder, = (f.parent for f in repros.glob("*/spec.json")
               if json.loads(f.read_text())["op"] == "aten.logcumsumexp.default")
    return chip, repros, folder


def test_the_task_writer_and_its_checker(tmp_path):
    chip, repros, folder = _repro(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "torch_kernelize.repros", "task", str(folder)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    task = (folder / "task.md").read_text()
    spec = json.loads((folder / "spec.json").read_text())["spec"]
    for text in (spec["key"], "aten::logcumsumexp(Tensor self, int dim) -> Tensor",
                 "torch.ops.aten.logcumsumexp.default(arg0, -1)", "| input 0 | [8, 64] | [64, 1] | float32 |",
                 "| output 0 | [8, 64] | [64, 1] | float32 |", "- dim = -1", "float64", "atol 0.0001, rtol 0.0001",
                 "`special`", "`large`", "`captured`", "poison", "vendor kernel: not measured",
                 "bytes read + written at least: 4,096", "`launch(*args)`",
                 f'SPECS = ["{spec["key"]}"]', "check_candidate.py"):
        assert text in task, text

    def check(candidate: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(folder / "check_candidate.py"), str(candidate), "--target",
                               str(chip)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    good = check(EXAMPLE)
    assert good.returncode == 0 and "ACCEPTED" in good.stdout, good.stdout + good.stderr
    broken = write(tmp_path, "broken.py", EXAMPLE.read_text().replace(
        "    hi = tl.maximum(a, b)\n", "    hi = tl.maximum(a, b)\n    return tl.log(tl.exp(a) + tl.exp(b))\n", 1))
    assert "return tl.log(tl.exp(a)" in broken.read_text()
    bad = check(broken)  # log(exp(a) + exp(b)) overflows: the large-values trial catches it
    assert bad.returncode == 1 and "REJECTED: trial" in bad.stdout and "(large," in bad.stdout, bad.stdout
    unknown = check(CANDIDATES / "sigmoid_ok.py")
    assert unknown.returncode == 2 and "does not say it is for this spec" in unknown.stderr, unknown.stderr


def test_demo_external_runs_end_to_end_and_serves_the_candidate_without_its_file(tmp_path):
    """The documented second demo command (make demo-external), with a copy of the example as the
    candidate: its cache entry records the file's hash and its launches, verifies, and a compile
    after the file is deleted still runs the kernel (serving needs nothing of the file)."""
    import hashlib

    from torch_kernelize.fill_cache.verify import verify_entries
    from torch_kernelize.kernel_cache import KernelCache
    from torch_kernelize.model_zoo import make_log_scan

    from torch_kernelize import demo_external
    assert demo_external.EXAMPLE == EXAMPLE and EXAMPLE.is_file()  # the command's default candidate
    candidate, work = tmp_path / "mine.py", tmp_path / "work"
    candidate.write_text(EXAMPLE.read_text())
    proc = subprocess.run([sys.executable, "-m", "torch_kernelize.demo_external", "--workdir", str(work),
                           "--candidate", str(candidate)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ACCEPTED" in proc.stdout and "family 'external'" in proc.stdout
    assert "aten.logcumsumexp.default on the triton tier: True" in proc.stdout

    chip, cache = work / "chip.toml", work / "cache"
    folder, = (f.parent for f in (work / "repros").glob("*/spec.json")
               if json.loads(f.read_text())["op"] == "aten.logcumsumexp.default")
    spec = KernelSpec.from_json(json.loads((folder / "spec.json").read_text())["spec"])
    assert family_for(spec).name == "scan"  # the candidate competed with the scan family's kernel (a tie here)
    store = KernelCache.for_target(cache, get_target(str(chip)))
    status, entry, _ = store.lookup(spec.key)
    assert status == "hit" and entry.family == "external"
    record = json.loads(next(cache.glob(f"*/entries/{spec.key}/entry.json")).read_text())
    assert record["provenance"]["candidate"]["sha256"] == hashlib.sha256(EXAMPLE.read_bytes()).hexdigest()
    assert record["provenance"]["generator"] == "external" and record["validation"]["ok"]
    program = json.loads(next(cache.glob(f"*/entries/{spec.key}/program/program.json")).read_text())
    assert [l["kernel"] for l in program["launches"]] == ["logcumsumexp_kernel"]
    verdict, = verify_entries(store, get_target(str(chip)), [spec.key])  # tools/cache.py verify
    assert verdict.ok, verdict.detail

    torch._dynamo.reset()
    model, inputs = make_log_scan()
    report = tmp_path / "report.json"
    compiled = torch.compile(model, backend="kernelize", options={
        "target": str(chip), "cache_dir": str(cache), "repro_dir": "off", "report": str(report),
        "graph_cache": "off"})
    candidate.unlink()
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs))
    nodes = [n for g in json.loads(report.read_text())["graphs"] for n in g["nodes"]]
    node, = (n for n in nodes if n["op"] == "aten.logcumsumexp.default")
    assert node["tier"] == "triton", node


def test_fill_cache_exits_2_for_a_candidate_no_reproducer_is_for(tmp_path, capsys):
    from torch_kernelize.fill_cache.cli import main
    (tmp_path / "repros").mkdir()
    code = main(["--quiet", "--repros", str(tmp_path / "repros"), "--target", "interpreter", "--cache-dir",
                 str(tmp_path / "cache"), "--candidate", str(CANDIDATES / "sigmoid_ok.py")])
    assert code == 2 and "it is for op aten.sigmoid.default, which no reproducer" in capsys.readouterr().err
