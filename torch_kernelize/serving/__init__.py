"""Serving: what runs a lowered graph. The runtime's flat functions, the loaders of stored
binaries, the run-time checks, and the recording of misses as reproducers. Builds on core and
kernel_cache; compiles nothing."""
