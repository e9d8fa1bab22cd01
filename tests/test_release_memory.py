"""qexp.core.timing.release_memory: what the deploy stage and the compile call between stages to hand freed heap pages
back to the OS (its peak memory). Linux/glibc only, like the machines qexp runs on."""

from __future__ import annotations

import gc
import os
import sys

import pytest
import torch

from qexp.core.timing import release_memory


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_heap_tensors_leave_the_process_only_with_release_memory():
    """Tensors of a few MB come from malloc's heap once a larger block has been freed (glibc raises its mmap
    threshold), and freeing them does not lower RSS; release_memory does."""
    big = torch.ones(8 * 2**20 // 4)  # 8 MiB, mapped on its own; freeing it raises glibc's mmap threshold
    del big
    chunks = [torch.ones(2**20 // 4) for _ in range(300)]  # 300 MiB of 1 MiB tensors from the heap
    pin = torch.ones(2**20 // 4)  # above them on the heap: the freed pages cannot simply be cut off its top
    del chunks
    gc.collect()
    freed = _rss_mib()
    release_memory()
    assert freed - _rss_mib() > 150, "malloc_trim handed back less than half of 300 MiB of freed tensors"
    assert pin.sum() == 2**20 // 4
