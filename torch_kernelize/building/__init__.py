"""Building: turning a KernelProgram into a program folder with compiled binaries (Triton, nvcc).
Runs where the cache is filled, never on the serving path."""
