"""KernelCompiles: the Triton kernel variants this process has had to compile (or load from the
disk cache), counted by kernel, for get_server_info: a benchmark compares the counts before and
after what it times to see whether anything compiled inside it (the warm-up's purpose).

Counted through Triton's jit_cache_hook, which Triton calls each time a kernel needs a variant
its process has not built yet; the hook returns False, so the variant is built as usual. The
count is the process's: `process_compiles` is installed once, by the scheduler process.
"""

from __future__ import annotations

from collections import Counter
from typing import Any


class KernelCompiles:
    def __init__(self) -> None:
        self.by_kernel: Counter[str] = Counter()
        self.installed = False

    def install(self) -> KernelCompiles:
        """Starts counting (once; a Triton without the hook leaves it uninstalled)."""
        try:
            from triton import knobs
        except ImportError:
            return self
        if self.installed or not hasattr(knobs.runtime, "jit_cache_hook"):
            return self
        previous = knobs.runtime.jit_cache_hook

        def counted(*args: Any, **kwargs: Any) -> bool:
            info = kwargs.get("fn")
            self.by_kernel[getattr(info, "name", "?")] += 1
            return bool(previous(*args, **kwargs)) if previous is not None else False

        knobs.runtime.jit_cache_hook = counted
        self.installed = True
        return self

    def info(self) -> dict[str, Any]:
        """{"kernel_compiles": total, "kernel_compiles_by_kernel": {name: count}}, or {} when
        not counting."""
        if not self.installed:
            return {}
        return {
            "kernel_compiles": sum(self.by_kernel.values()),
            "kernel_compiles_by_kernel": dict(self.by_kernel),
        }


process_compiles = KernelCompiles()
