"""Time this process spent inside our own collectives (the flag agreement, the votes, the straggler exchange).

A rank that reaches one of them early waits there for the last rank. That wait is not its own work: telemetry's
straggler attribution (``callbacks/arrivals.py``) counts it as waiting, so the rank that waits is never taken for the
rank that is slow. Two clock reads per collective; one float per process.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

_WAITED = [0.0]


@contextmanager
def waiting():
    """Around one of our collectives: its time is added to this process's waiting."""
    start = time.perf_counter()
    try:
        yield
    finally:
        _WAITED[0] += time.perf_counter() - start


def waited_so_far() -> float:
    """Seconds this process has waited in our collectives since it started: read at two points, the difference is
    the waiting between them."""
    return _WAITED[0]
