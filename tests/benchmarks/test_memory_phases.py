"""benchmarks/memory_phases.py: glibc's own figures and the per-phase table."""

from __future__ import annotations

import ctypes

from benchmarks.memory_phases import malloc_info, table


def test_malloc_info_sees_a_block_malloc_holds_and_frees():
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    before = malloc_info()
    block = libc.malloc(64 * 2**20)  # above any mmap threshold: an mmapped chunk, counted as in use
    during = malloc_info()
    libc.free(block)
    assert during["in_use"] - before["in_use"] >= 64 * 2**20
    assert malloc_info()["in_use"] < during["in_use"]


def test_the_table_has_a_row_per_phase_in_mib():
    row = {"phase": "step 0: after forward", "rss_anon": 3 * 2**20, "peak_anon_since_last": 4 * 2**20,
           "tensors_model_state": 2**20, "malloc": {"in_use": 2 * 2**20, "free_retained": 2**20}}  # fmt: skip
    assert table([row]).splitlines()[-1] == "| step 0: after forward | 3 | 4 | 1 | 2 | 1 |"
