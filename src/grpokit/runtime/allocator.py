"""Keep freed memory in the process rather than handing it back to the operating system.

glibc's malloc gives every allocation above a threshold (128 KiB, rising to at most 32 MiB) pages
of its own from the kernel and returns them on free, so a training step, which allocates and frees
the same activations and gradients every time, pays a page fault for every page of them, every
step: on a small CPU machine, a large share of the update. keep_freed_memory() serves every
allocation from malloc's heap and never shrinks it, so freed tensors' pages are reused. The cost
is memory that stays with the process once freed, in the middle of the heap included: a somewhat
higher peak resident memory, which creeps up in steps over a run instead of going up and down
(docs/speed-and-memory.md, "Speed: grpokit against TRL", has the measured figures, and the
commands that give them).

It changes malloc for the whole process, so the library leaves the choice to the program:
`grpokit train` calls it, and so may any program that builds a Trainer itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Tune glibc's malloc for this process as the module docstring says; False where the C
    library is not glibc (nothing to tune)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # No allocation gets pages of its own (mmap); the heap is trimmed only when more than 2 GiB
    # (the largest int mallopt takes) is free at its top. mallopt returns 1 on success.
    return bool(libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
