"""Tier 4: what runs a node that nothing on the target can run. Installed as torch_kernelize.fallbacks."""
from torch_kernelize.fallbacks.host import HostFallback, expected_fallbacks, fallback_stats, reset_fallback_stats

__all__ = ["HostFallback", "expected_fallbacks", "fallback_stats", "reset_fallback_stats"]
