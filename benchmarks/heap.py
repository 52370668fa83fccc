"""The C heap a CPU benchmark's training steps allocate from, and the page faults it costs them.

On a CPU, Inductor's compiled graphs allocate their buffers with ``malloc`` at every call. glibc's
``malloc`` serves a large request (above its dynamic threshold, at most 32 MB) with a fresh
``mmap``, and returns the top of its heap to the system once more than a threshold of it is free.
Memory handed back is mapped afresh when next asked for, and the kernel then zeroes every page as
the step first touches it: a minor page fault, half a microsecond to a microsecond each. How many a
step takes depends on glibc's heuristics and on what the process allocated and freed before, not on
the step's work. The full CNN of ``benchmarks.overhead``, timed in a process of two methods
(torch.amp's and autoscale's, 2-core CPU, 2026-11-28), took 1,600-6,000 faults a step, about 2.2 ms
of torch.amp's 17.6 ms, the two methods hundreds to thousands apart; in the benchmark's own
process, with its six methods, the compiled steps took none once warm, under either heap.

:func:`retain_freed_memory` has glibc keep what it frees for reuse, as a caching allocator does:
as PyTorch's own CUDA allocator does on a GPU, and jemalloc or tcmalloc, which PyTorch's CPU
launcher (``torch.backends.xeon.run_cpu``) preloads, on a CPU. The steps then fault no page once
warm, and what a benchmark times is the steps' work. For benchmarks only: a library must not
change its process's allocator.
"""

from __future__ import annotations

import ctypes
import resource

__all__ = ["page_faults", "retain_freed_memory"]

_M_TRIM_THRESHOLD = -1
"""mallopt's parameter: how much free memory at the heap's top glibc keeps before returning it."""
_M_MMAP_MAX = -4
"""mallopt's parameter: how many allocations glibc may serve with mmap at once (0: none)."""
_INT_MAX = 2**31 - 1


def retain_freed_memory() -> bool:
    """Have glibc's ``malloc`` serve every allocation from its heap (no ``mmap`` of its own) and
    never return the heap's free top to the system, for the rest of the process. Whether it could:
    False where the C library is not glibc (no ``mallopt``), or refused a setting."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _INT_MAX))


def page_faults() -> int:
    """The minor page faults this process has taken so far (pages the kernel mapped, and zeroed,
    at their first touch)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
