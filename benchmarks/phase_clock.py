"""Run a training script unchanged and note when its first and last optimizer steps end (benchmarks/phases.py).

    python benchmarks/phase_clock.py RECORD SCRIPT [ARGS ...]

A global optimizer-step hook of torch's (``register_optimizer_step_post_hook``) writes the wall-clock times of the
first and the latest optimizer step into RECORD with one ``pwrite`` each (a process that ends with ``os._exit`` has
written them already). The script runs as ``__main__`` with its own arguments; what it imports and does is untouched.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time


def main() -> None:
    record, script, *args = sys.argv[1:]
    from torch.optim.optimizer import register_optimizer_step_post_hook

    fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    times: dict[str, float] = {}

    def noted(optimizer, *unused) -> None:
        now = time.time()
        times.setdefault("first_step_end", now)
        times["last_step_end"] = now
        times["steps"] = times.get("steps", 0) + 1
        os.pwrite(fd, json.dumps(times).encode().ljust(256), 0)

    register_optimizer_step_post_hook(noted)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
