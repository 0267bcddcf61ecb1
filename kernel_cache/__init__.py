"""The kernel cache: keys, entries, locking, integrity, signed export/import. Installed as torch_kernelize.kernel_cache.

Shared by concurrent processes that can be killed at any moment: entries are written to a temp
folder and renamed into place under a per-key lock, every file is covered by a sha256 manifest,
and an entry that fails its checks is skipped with one warning, never trusted or fatal.
"""
from torch_kernelize.core.errors import CacheError

from .archive import CheckedArchive, ImportResult, export_cache, import_cache, verify_archive
from .entry import FORMAT, CacheEntry, better, check_key, normalize_record
from .store import KernelCache, LookupLog, clear_memo

__all__ = [
    "CacheEntry", "CacheError", "CheckedArchive", "FORMAT", "ImportResult", "KernelCache", "LookupLog", "better",
    "check_key", "clear_memo", "export_cache", "import_cache", "normalize_record", "verify_archive",
]
