"""allocator.py: after keep_freed_memory(), freed tensors' memory is reused, not handed back."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.process  # the probe runs in a fresh Python process

PROBE = r"""
import ctypes, sys, torch
from grpokit.runtime.allocator import keep_freed_memory

class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2

def mapped_by_a_128_mb_tensor():
    x = torch.empty(32 * 1024 * 1024)  # 128 MiB, as a 49k x 576 vocabulary table's gradient
    inside = libc.mallinfo2().hblkhd  # bytes in blocks with pages of their own (mmap)
    del x
    return inside - libc.mallinfo2().hblkhd

before = mapped_by_a_128_mb_tensor()
assert keep_freed_memory()
after = mapped_by_a_128_mb_tensor()
x = torch.empty(32 * 1024 * 1024); del x
kept = libc.mallinfo2().fordblks  # free bytes the heap holds on to
print(before, after, kept)
"""


def test_freed_tensors_stay_in_the_heap():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout.split()
    before, after, kept = map(int, out)
    assert before >= 128 * 2**20  # glibc's default: a 128 MiB block gets its own pages, given back on free
    assert after == 0  # from the heap instead
    assert kept >= 128 * 2**20  # and still held after the tensor is gone
