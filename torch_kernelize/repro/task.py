"""A reproducer as a task for a person or an agent: task.md and check_candidate.py in its folder.

    python -m torch_kernelize.repros task kernelize_repros/<folder>

task.md says everything a kernel for the reproducer's spec must do and how it will be judged:
the op as ATen code and its schema, every tensor's shape, strides and dtype, the reference
semantics, the tolerance, the trials (seeds, edge values, captured inputs, filled outputs),
the vendor kernel's time where a GPU is present, the bytes (and FLOPs) floor, and the candidate
contract. check_candidate.py validates a candidate exactly as fill_cache does (the same
recorder, generator and measurer: fill_cache/external.py).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from torch_kernelize.lowering.kernels import KernelFamily, family_for
from torch_kernelize.core.costs import bytes_moved
from torch_kernelize.core.spec import KernelSpec, TensorMeta
from torch_kernelize.core.tolerances import TOLERANCES, tolerance
from torch_kernelize.core.validate import DEFAULT_SEEDS
from torch_kernelize.serving.repro_inputs import read_inputs, read_meta

TASK_FILE, CHECK_FILE = "task.md", "check_candidate.py"
# Measured on the lent H200 (shared/notes/torch-triton-facts.md): what the floors below divide by
H200_BYTES_PER_S = 4.23e12
H200_BF16_FLOPS = 729e12
MATMULS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"}

EDGE_VALUES = {
    "random": "standard normal values (integers: uniform in [-8, 9); the op's family may narrow the domain)",
    "zeros": "all zeros",
    "large": "normal values times 1e4 (fp16: 1e3): overflow and cancellation",
    "negative": "-|normal| - 0.5: strictly negative",
    "special": "normal values with 1/16 of the elements set to inf, -inf, NaN, 0.0 or -0.0",
}

CHECK_SCRIPT = '''\
"""Check a candidate kernel file against this reproducer exactly as fill_cache does.

    python check_candidate.py my_kernel.py [--target cuda|interpreter] [--time]

Exit 0: accepted (on a GPU with its time beside the vendor kernel's); 1: rejected, with the
first failing trial; 2: it could not be checked. Needs torch_kernelize installed.
"""
import sys
from pathlib import Path

from torch_kernelize.fill_cache.external import check_main

if __name__ == "__main__":
    sys.exit(check_main(Path(__file__).resolve().parent, sys.argv[1:]))
'''


def write_task(folder: Path) -> Path:
    """Write task.md and check_candidate.py into the reproducer ``folder``; return task.md's path."""
    folder = Path(folder)
    meta = read_meta(folder)
    if not meta.get("spec"):
        raise ValueError(f"{folder} records a graph that failed to lower, not one op's spec: there is no "
                         "kernel task in it")
    spec = KernelSpec.from_json(meta["spec"])
    read_inputs(folder, spec)  # the folder's checks (data only: its repro.py is not run)
    code = (folder / "graph.py").read_text() if (folder / "graph.py").exists() else ""
    (folder / TASK_FILE).write_text(render_task(spec, meta, code, folder))
    (folder / CHECK_FILE).write_text(CHECK_SCRIPT)
    return folder / TASK_FILE


def _domain_lines(spec: KernelSpec) -> list[str]:
    """What the op requires of its inputs' values (core/input_domains.py): every trial keeps it."""
    from torch_kernelize.core.input_domains import requirements
    rules = requirements(spec)
    if not rules:
        return []
    return ["Input domains (the op rejects other values; every trial's inputs keep these):", "",
            *[f"- input {i}: {text}" for i, text in sorted(rules.items())], ""]


def _meta_row(name: str, m: TensorMeta) -> str:
    return f"| {name} | {list(m.shape)} | {list(m.stride)} | {m.dtype} |"


def _arguments(spec: KernelSpec) -> list[str]:
    """The node's arguments in the schema's order, as ``launch`` receives them."""
    schema = spec.op_overload._schema if spec.graph is None else None
    names = [a.name for a in schema.arguments] if schema is not None else []

    def show(x):
        if isinstance(x, dict) and "tensor" in x:
            return f"tensor input {x['tensor']} ({spec.inputs[x['tensor']].short()})"
        return json.dumps(x)
    out = [f"{names[i] if i < len(names) else f'arg{i}'} = {show(a)}" for i, a in enumerate(spec.args)]
    out += [f"{k} = {show(v)} (keyword)" for k, v in spec.kwargs.items()]
    return out


def _floors(spec: KernelSpec) -> list[str]:
    moved = bytes_moved(spec)
    lines = [f"- bytes read + written at least: {moved:,} -> {moved / H200_BYTES_PER_S * 1e6:.3g} us at the "
             f"H200's measured copy ceiling ({H200_BYTES_PER_S / 1e12:.2f} TB/s)"]
    if spec.op in MATMULS:
        a, b = spec.inputs[-2], spec.inputs[-1]
        flops = 2 * math.prod(spec.outputs[0].shape) * a.shape[-1]
        lines.append(f"- FLOPs: {flops:,} -> {flops / H200_BF16_FLOPS * 1e6:.3g} us at the H200's measured bf16 "
                     f"matmul ceiling ({H200_BF16_FLOPS / 1e12:.0f} TFLOP/s); inputs {a.short()} @ {b.short()}")
    return lines


VENDOR_TIMING_SEED = 0  # the inputs the task's vendor time is measured on (any random draw will do)


def _vendor_time(spec: KernelSpec, family: KernelFamily) -> str:
    if not torch.cuda.is_available():
        return ("not measured (no GPU where this task was written): `python check_candidate.py FILE` on a GPU "
                "prints the vendor kernel's and the candidate's median times")
    from torch_kernelize.fill_cache.benchmark import median_ms
    cuda_spec = KernelSpec(spec.op, spec.args, spec.kwargs,
                           tuple(TensorMeta(m.shape, m.stride, m.dtype, "cuda") for m in spec.inputs),
                           tuple(TensorMeta(m.shape, m.stride, m.dtype, "cuda") for m in spec.outputs),
                           spec.tuple_output, spec.graph)
    inputs = family.sample_inputs(cuda_spec, VENDOR_TIMING_SEED, "random", "cuda")
    ms = median_ms(lambda: cuda_spec.run_vendor(inputs))
    return f"{ms * 1e3:.2f} us median on {torch.cuda.get_device_name()} (triton.testing.do_bench)"


def render_task(spec: KernelSpec, meta: dict, code: str, folder: Path) -> str:
    family = family_for(spec)
    judge = family or KernelFamily()
    edge = ["random"] + list(judge.edge_kinds)
    tols = {m.dtype: tolerance(m.torch_dtype, spec.op) for m in spec.outputs}
    schema = str(spec.op_overload._schema) if spec.graph is None else "(a fused region: see the code)"
    domain = (f"Inputs are drawn by the `{family.name}` family's `sample_inputs` (it may narrow the domain the op "
              "is defined on, e.g. index ranges)." if family is not None else
              "Inputs are drawn as described, with the spec's exact strides (views of a larger buffer included).")
    return "\n".join([
        f"# Task: a kernel for `{spec.op}` (spec `{spec.key}`)",
        "",
        f"Reproducer `{folder.name}` ({meta.get('kind', '?')}: {meta.get('what', '')}), recorded on target "
        f"`{meta.get('target', '?')}`. Write a candidate file (contract below); it is accepted when it computes "
        "what the reference computes on every trial, and stored when it is also faster than the vendor kernel "
        "and the generated kernels on the GPU.",
        "",
        "## What to compute",
        "",
        f"Schema: `{schema}`",
        "",
        "The op as ATen code (`graph.py`; `repro.py` runs it standalone):",
        "",
        "```python", code.strip(), "```",
        "",
        "`launch` is called with these arguments, in this order:",
        "",
        *[f"- {a}" for a in _arguments(spec)],
        "",
        "| tensor | shape | stride | dtype |", "|---|---|---|---|",
        *[_meta_row(f"input {i}", m) for i, m in enumerate(spec.inputs)],
        *[_meta_row(f"output {i}", m) for i, m in enumerate(spec.outputs)],
        "",
        "Each output must be a new tensor of exactly that shape, stride and dtype (`torch.empty_strided`); "
        f"the op returns {'a tuple' if spec.tuple_output else 'one tensor'}.",
        "",
        *_domain_lines(spec),
        "## Reference semantics",
        "",
        "The float64 reference: every floating input upcast to float64 and the op run by PyTorch's ATen on the CPU "
        "(fill_cache may compute large references on the GPU, IEEE float64 either way). Integer outputs must "
        "match exactly. The captured inputs are in `inputs/`, their reference in `reference.pt`.",
        "",
        "## Tolerance",
        "",
        "Elementwise `|out - ref| <= atol * scale + rtol * |ref|`, with `scale = max(1, max |ref|)` over the finite "
        "reference values; NaN exactly where the reference has NaN, infinities equal (sign included).",
        "",
        *[f"- output dtype {d}: atol {a:g}, rtol {r:g}" + (" (exact)" if (a, r) == (0, 0) else "")
          for d, (a, r) in tols.items()],
        f"- for comparison, the table per dtype: "
        + ", ".join(f"{str(k).removeprefix('torch.')} {v}" for k, v in TOLERANCES.items()),
        "",
        "## Trials (all must pass; the first failure is reported with its kind, seed, error and index)",
        "",
        *[f"- `{k}`: {EDGE_VALUES.get(k, k)}" + (f" (seeds {', '.join(map(str, DEFAULT_SEEDS))})"
                                                   if k == "random" else "") for k in edge],
        "- `captured`: the inputs this reproducer captured",
        "",
        f"{domain} Each trial runs the kernel twice on the same inputs, its outputs (and the buffers it allocates "
        "uninitialised) filled differently before each run: once with a poison (NaN; integers near their minimum), "
        "once with values it cannot predict. Both runs must give the same bits, so an element the kernel does not "
        "write, or reads before writing, fails. After each run every input must be unchanged, bit for bit.",
        "",
        "## Performance",
        "",
        f"- vendor kernel: {_vendor_time(spec, judge)}",
        *_floors(spec),
        "",
        "## The candidate contract",
        "",
        "- A Python file with `@triton.jit` kernels defined at its top level and `launch(*args)`, called with the "
        "arguments above (tensors and scalars as the op receives them), returning the op's output(s).",
        f"- It says what it is for: `SPECS = [\"{spec.key}\"]` (this spec), or `OP = \"{spec.op}\"` (every shape "
        "of the op).",
        "- `launch` may only read sizes, strides and dtypes, allocate (`torch.empty`/`empty_strided`/`zeros`/"
        "`full`, their `_like` forms, `fill_`/`zero_` of a new buffer) and launch its kernels with "
        "`kernel[grid](...)` (`num_warps`, `num_stages` allowed). fill_cache runs it once per shape with every "
        "launch recorded (kernel, grid, constexprs, argument order, buffers) into a program; serving replays "
        "that program's compiled binaries and never calls `launch` again.",
        "- Rejected: computing with torch on the host, reading tensor values (`.item()`), launches that differ "
        "with the input values, writing to an input, returning an input or a tensor kept from an earlier call, "
        "side streams, precision below the tolerance, reading an output's old contents.",
        "",
        "## Check and submit",
        "",
        "```",
        "python check_candidate.py my_kernel.py                 # exit 0 accepted, 1 rejected, 2 error",
        f"python -m torch_kernelize.fill_cache --repros {folder.parent} --candidate my_kernel.py --target <target>",
        "```",
        "",
    ])
