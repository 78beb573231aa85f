"""The C library's allocator functions (glibc's ``mallopt``, ``malloc_trim``), for the two places that steer it:
``levers/release_memory.py`` (freed memory given back at once) and ``tune/resident_memory.py`` (a trial not charged
for the one before it)."""

from __future__ import annotations

import ctypes
import ctypes.util


def c_function(name: str):
    """The C library's function ``name``, or None (no C library found, or one without it: not glibc)."""
    library = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(library), name, None) if library else None
    except OSError:
        return None
