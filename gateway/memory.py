"""Giving the gateway's freed memory back to the OS (glibc).

Hostile prompts are a few large buffers each (the body, the decoded text), and a body arrives in 64 KiB chunks.
glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), so later large buffers come
from the heap, and freed heap stays with the process. `mmap_large_blocks()` fixes the threshold (blocks from
MMAP_THRESHOLD up are mapped and unmapped, never kept), and `HeapTrimmer` runs malloc_trim(0) (the free pages of
every arena back to the OS) in a thread once requests stop: at the end of the first TRIM_EVERY_S period in which no
request came, after one in which some did. Not while they keep coming: malloc_trim holds each arena's lock while it
walks it, and the event loop's thread allocates from the main arena, so the loop waits for the trim even though
ctypes dropped the GIL (the 2-core CPU machine: a trim of a ~120 MB fragmented heap took 14-18 ms and stalled
another thread's allocations for 9-12 ms; ~600 MB: 44-67 and 39-62 ms; docs/reliability.md). Under load the heap's
freed pages are reused, and large blocks are unmapped anyway. Measured with the hostile soak (tests/test_faults.py):
the gateway's RSS came back within 10 % of its baseline (+2.6 and +3.5 MB) with both, and not within 15 s without
them.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util

TRIM_EVERY_S = 5.0
MMAP_THRESHOLD = 256 << 10
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def _glibc(name: str):
    """A glibc function, or None (another libc: nothing to do)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def mmap_large_blocks() -> None:
    mallopt = _glibc("mallopt")
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


class HeapTrimmer:
    def __init__(self):
        self.dirty = False  # set by every request with a body
        self._owed = False  # requests came since the last trim
        self._trim = _glibc("malloc_trim")

    def due(self) -> bool:
        """Called at the end of each TRIM_EVERY_S period: whether to trim now (no request came in this period, and
        some did since the last trim)."""
        busy, self.dirty = self.dirty, False
        owed, self._owed = self._owed or busy, busy
        return owed and not busy

    async def run(self) -> None:
        if self._trim is None:
            return
        while True:
            await asyncio.sleep(TRIM_EVERY_S)  # a timer, not synchronisation
            if self.due():
                await asyncio.to_thread(self._trim, 0)
