"""leave_process_group: the entry points' last step after a finished run (hf_gpu_train/process_group.py says why)."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import sys
from hf_gpu_train.process_group import leave_process_group
assert leave_process_group() is False and "torch" not in sys.modules  # no torch, no group, nothing imported
import torch.distributed as dist
assert leave_process_group() is False  # torch without a group
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
assert dist.is_initialized()
assert leave_process_group() is True and not dist.is_initialized()
assert leave_process_group() is False
print("OK")
"""


def test_the_default_group_is_destroyed_once_and_torch_is_never_imported_for_it(tmp_path):
    run = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "store")], capture_output=True, text=True, timeout=120)
    # (some torch versions' Gloo prints its connection count to stdout first)
    assert run.returncode == 0 and run.stdout.strip().splitlines()[-1:] == ["OK"], run.stdout[-2000:] + run.stderr[-2000:]


EXIT_CHILD = """
import atexit, sys
import torch.distributed as dist
from hf_gpu_train.process_group import exit_process
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
atexit.register(lambda: print("GROUP", dist.is_initialized()))
exit_process(int(sys.argv[2]))
"""


def test_an_entry_point_leaves_the_group_after_success_only_and_keeps_its_exit_code(tmp_path):
    for code, still_there in ((0, False), (2, True)):
        run = subprocess.run([sys.executable, "-c", EXIT_CHILD, str(tmp_path / f"store{code}"), str(code)],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == code and run.stdout.strip().splitlines()[-1:] == [f"GROUP {still_there}"], run.stderr[-2000:]
