"""The trials' extension point (``HF_GPU_TRAIN_TUNE_HOOKS=module:function``): the product names no test hook, calls the
one it is given, and keys the measurement cache by it and its settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_gpu_train.tune import hooks
from tests.tune import hooks as cpu_hooks


def test_without_a_hook_nothing_changes_and_the_cache_key_part_is_empty():
    collator = object()
    assert hooks.install(object(), collator, {cpu_hooks.OOM_ENV: "5"}) == (collator, [])
    assert hooks.cache_key_part({cpu_hooks.OOM_ENV: "5", "PATH": "/bin"}) == {}  # a user's key, as it always was


def test_the_named_hook_is_called_and_keys_the_cache_with_its_settings():
    import torch

    env = {**cpu_hooks.environment(oom_above=3, collate_sleep_s=0.0), "PATH": "/bin"}
    model = torch.nn.Linear(2, 2)
    collator, notes = hooks.install(model, list, env)
    assert isinstance(collator, cpu_hooks.SlowCollate) and collator([1, 2]) == [1, 2]
    assert any("more than 3 samples" in n for n in notes) and model._forward_pre_hooks  # the injector is on
    assert hooks.cache_key_part(env) == {hooks.HOOKS_ENV: cpu_hooks.HOOK, cpu_hooks.OOM_ENV: "3",
                                         cpu_hooks.SLOW_COLLATE_ENV: "0.0"}
    bare = torch.nn.Linear(2, 2)
    collator, notes = hooks.install(None, list, env)  # another layout's collator: the model is left alone
    assert isinstance(collator, cpu_hooks.SlowCollate) and len(notes) == 1 and not bare._forward_pre_hooks


def test_a_malformed_hook_is_refused_before_any_trial(tmp_path):
    from hf_gpu_train.tune.job import TuneError, load_job

    env = {hooks.HOOKS_ENV: "tests/tune/hooks.py"}
    assert "is not module:function" in hooks.problem(env)
    with pytest.raises(ValueError, match="module:function"):
        hooks.install(None, list, env)
    with pytest.raises(TuneError, match="module:function"):
        load_job(str(tmp_path / "missing.yaml"), "scripts/finetune.py", [], {}, environ=env)


def test_the_package_holds_no_test_hook():
    package = Path(hooks.__file__).parent
    assert not (package / "cpu_hooks.py").exists()
    assert not any("TEST_OOM" in f.read_text() for f in package.parent.rglob("*.py"))
