"""NAME.tune.json: what the key depends on, what is kept, and files that are not ours."""

from __future__ import annotations

import json

import pytest

from hf_gpu_train.hardware.snapshot import load_machine
from hf_gpu_train.tune.cache import TuneCache, TuneCacheError, cache_key, job_identity, machine_fingerprint
from hf_gpu_train.tune.candidates import Candidate
from hf_gpu_train.tune.results import OK, SKIPPED, TrialResult

C = Candidate(micro_batch=8, accumulation=2, gradient_checkpointing=False, dataloader_num_workers=0, precision="fp32")


def key(machine="1x-h200", **values) -> str:
    job = {"model": "m", "max_length": 128, "learning_rate": 5e-5, "output_dir": "a", **values}
    return cache_key({"machine": machine_fingerprint(load_machine(machine)), "job": job_identity(job), "effective_batch": 32})


def test_the_key_follows_the_machine_and_what_changes_a_step_not_the_learning_rate_or_the_output():
    assert key() == key(learning_rate=1e-3, output_dir="b", num_train_epochs=9)
    assert key() != key(max_length=256) and key() != key(model="other") and key() != key(machine="1x-t4")


def test_a_local_data_file_joins_the_key_by_size_and_time(tmp_path):
    data = tmp_path / "train.csv"
    data.write_text("text,label\na,0\n")
    before = job_identity({"train_file": str(data)})
    data.write_text("text,label\na,0\nb,1\n")
    assert job_identity({"train_file": str(data)}) != before


def test_measurements_round_trip_skipped_ones_are_not_kept_and_fresh_replaces(tmp_path):
    path = tmp_path / "box.tune.json"
    cache = TuneCache.load(path)
    ran = TrialResult(C, OK, samples_per_s=10.0, step_times_s=(0.1, 0.2, 0.1), seconds=3.0)
    skipped = TrialResult(C.with_micro_batch(4), SKIPPED, "budget")
    cache.store("k", {"model": "m"}, [ran, skipped])
    cache.save()
    again = TuneCache.load(path)
    assert again.results("k") == {C.key: ran} and again.results("other") == {}
    other = TrialResult(C.with_micro_batch(16), OK, samples_per_s=12.0, seconds=2.0)
    again.store("k", {"model": "m"}, [other], fresh=True)
    assert set(again.results("k")) == {other.candidate.key}


def test_a_file_that_is_not_ours_is_never_overwritten(tmp_path):
    foreign = tmp_path / "box.tune.json"
    foreign.write_text(json.dumps({"mine": True}))
    with pytest.raises(TuneCacheError, match="was not written by hf-gpu-train tune: move it away"):
        TuneCache.load(foreign, fresh=True)
    broken = tmp_path / "b.tune.json"
    broken.write_text("{not json")
    with pytest.raises(TuneCacheError, match="not readable as JSON .* pass --fresh"):
        TuneCache.load(broken)
    assert TuneCache.load(broken, fresh=True, stamp="S").entries == {}
    assert (tmp_path / "b.tune.json.bak-S").read_text() == "{not json"
