"""release_memory=true (issue 19): freed memory goes back to the system at once. On the CPU glibc's adaptive mmap
threshold keeps freed activation-sized blocks in its heaps, so the resident set stays at the step's high-water mark;
with the threshold fixed it follows what the process holds. Run in subprocesses: mallopt cannot be undone in the test
process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hf_gpu_train.levers.release_memory import CUDA_SETTING, release_on_cuda

PROBE = """
import json, sys, psutil, torch
from hf_gpu_train.levers.release_memory import release_on_the_cpu
line = release_on_the_cpu() if sys.argv[1] == "release" else ""
rss = lambda: psutil.Process().memory_info().rss
large = torch.ones(16 << 20, dtype=torch.uint8)
del large  # one large block freed: glibc raises its mmap threshold past 8 MiB
before = rss()
blocks = [torch.ones(8 << 20, dtype=torch.uint8) for _ in range(24)]  # 192 MiB of activation-sized blocks
keep = blocks[-1]  # the last one stays alive, as a step's outputs do, above the freed ones
del blocks
print(json.dumps({"held_mib": (rss() - before) / 2**20, "line": line}))
"""


def held(mode: str) -> dict:
    run = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_the_cpu_gives_freed_blocks_back_with_release_memory():
    default, released = held("default"), held("release")
    assert default["held_mib"] > 150  # 184 MiB freed, still resident: what inflated the benchmark's peak RSS
    assert released["held_mib"] < 32 and "mapped on their own" in released["line"]


def test_on_cuda_it_sets_expandable_segments_unless_the_user_chose():
    environ = {}
    assert CUDA_SETTING in release_on_cuda(environ) and environ["PYTORCH_CUDA_ALLOC_CONF"] == CUDA_SETTING
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    assert "is yours" in release_on_cuda(mine) and mine["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"


class _Stop(Exception):
    pass


def test_the_cuda_setting_is_in_the_environment_before_anything_asks_torch_about_cuda(monkeypatch, tmp_path):
    """torch reads PYTORCH_CUDA_ALLOC_CONF once, when CUDA starts; resolving the runtime asks torch about the GPUs
    (device properties), so the setting must be there before it, not after."""
    import os

    from hf_gpu_train.finetune import runtime
    from hf_gpu_train.finetune.loading import load_config
    from hf_gpu_train.finetune.run import finetune

    seen = {}

    def resolve(cfg, here=None):
        seen["at_resolve"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        raise _Stop

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # registered, so what finetune() sets is taken back after the test
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setattr(runtime, "resolve_runtime", resolve)
    cfg = load_config(None, ["release_memory=true", f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(_Stop):
        finetune(cfg)
    assert seen["at_resolve"] == CUDA_SETTING


def test_on_the_cpu_the_cuda_setting_is_taken_back_and_a_users_own_is_kept(monkeypatch):
    from types import SimpleNamespace

    from hf_gpu_train.levers import release_memory as module
    from hf_gpu_train.levers.from_config import release_memory, release_memory_before_cuda

    monkeypatch.setattr(module, "release_on_the_cpu", lambda: "glibc thresholds fixed")  # mallopt cannot be undone here
    cfg = SimpleNamespace(release_memory=True)
    environ = {}
    released = release_memory_before_cuda(cfg, environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": CUDA_SETTING}
    assert release_memory(cfg, SimpleNamespace(on_cuda=True), released, environ) == [released.line]
    assert environ["PYTORCH_CUDA_ALLOC_CONF"] == CUDA_SETTING
    assert release_memory(cfg, SimpleNamespace(on_cuda=False), released, environ) == ["glibc thresholds fixed"]
    assert "PYTORCH_CUDA_ALLOC_CONF" not in environ  # nothing on the CPU reads it; child processes do not inherit ours
    mine = {"PYTORCH_CUDA_ALLOC_CONF": CUDA_SETTING}  # the user's own, the same text: not ours to take back
    released = release_memory_before_cuda(cfg, mine)
    assert release_memory(cfg, SimpleNamespace(on_cuda=False), released, mine) == ["glibc thresholds fixed"]
    assert mine == {"PYTORCH_CUDA_ALLOC_CONF": CUDA_SETTING}
    assert release_memory(SimpleNamespace(release_memory=False), SimpleNamespace(on_cuda=False), None, {}) == []
