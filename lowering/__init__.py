"""Kernel generators: the op families that turn a concrete KernelSpec and a Config into a
KernelProgram, one module per family in kernels/.

    kernels/__init__.py    family_for(spec), family_for_op(name): the family that generates a spec
    kernels/registry.py    the table of families (first match wins)
    kernels/base.py        KernelFamily, the interface every generator implements (configs, seeds
                           and neighbours for fill_cache's search, input sampling for validation)
    kernels/_codegen.py    code generation helpers the families share (literal sizes and strides)
    kernels/recording.py   records the Triton launches of a Python launcher (a candidate file,
                           Inductor's output) into a KernelProgram
    kernels/*.cu           CUDA C++ sources that a family's generator reads (conv1d_bulk.cu)

This is the "generators" layer (test/test_layers.py): it imports core (and building, to ask
whether nvcc is there), and is used by compiling (does a family cover a node), fill_cache
(generate, validate, measure) and repro (a reproducer's task). What to lower and how lives
elsewhere: targets, specs and programs in torch_kernelize/core/; decomposition tables, op classes,
fused regions and the planner's tier ladder in torch_kernelize/compiling/.

Installed as ``torch_kernelize.lowering``; always import it by that name.
"""
