"""The kernel cache: keys, entries, locking, integrity, export/import. Installed as torch_kernelize.kernel_cache."""
