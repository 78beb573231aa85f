"""The passes over the rows run once per machine with several processes, and every rank gets the same datasets
as one process does (``finetune/prepare_once.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hf_gpu_train.finetune.loading import load_config
from hf_gpu_train.finetune.prepare_once import Prepared, data_key, prepare_once
from tests.finetune.tasks.language_modeling.tiny import chat_rows, save_tiny_model
from tests.launching import ROOT

PROBE = ROOT / "tests" / "finetune" / "prepare_probe.py"


def _ranks(tmp_path, name: str, world: int, runs: list[list[str]]) -> list[tuple[list[dict], list[str]]]:
    """Per run: (what each rank got, the ranks that ran a pass over the rows, once per call)."""
    out = tmp_path / name
    out.mkdir()
    base = {**os.environ, "PYTHONPATH": str(ROOT), "HF_GPU_TRAIN_CACHE": str(tmp_path / "cache"),
            "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(world)}
    argv = [a for run in runs for a in (*run, "--")][:-1]
    started = [subprocess.Popen([sys.executable, str(PROBE), str(out), *argv], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                                env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(world)]
    for process in started:
        _, err = process.communicate(timeout=240)
        assert process.returncode == 0, err[-3000:]
    return [([json.loads((out / f"rank{r}-{run}.json").read_text()) for r in range(world)],
             (out / f"passes-{run}.txt").read_text().split()) for run in range(len(runs))]


@pytest.mark.slow
def test_two_ranks_prepare_once_and_get_what_one_process_gets(tmp_path):
    rows = tmp_path / "chat.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in chat_rows(40)))
    runs = [["max_train_samples=64", "max_eval_samples=32"],  # text classification: MiniLM on builtin:text
            ["task=causal-lm", f"model={save_tiny_model(tmp_path / 'tiny')}", f"train_file={rows}", "generation_samples=0",
             "max_length=192"]]
    alone, both = _ranks(tmp_path, "one", 1, runs), _ranks(tmp_path, "two", 2, runs)
    for (single, single_passes), (ranks, passes) in zip(alone, both):
        # one process runs each pass once; of two processes, one rank runs them and the other loads its result
        assert len(passes) == len(single_passes) and len(set(passes)) == 1, passes
        for rank in ranks:
            assert (rank["train"], rank["validation"], rank["rows"]) == (single[0]["train"], single[0]["validation"], single[0]["rows"])
        assert any(f"by rank {passes[0]}" in note for note in ranks[0]["notes"]), ranks[0]["notes"]


def _built(counter: list) -> Prepared:
    counter.append(1)
    from datasets import Dataset

    return Prepared(Dataset.from_dict({"x": [1, 2, 3]}), Dataset.from_dict({"x": [4]}), {"notes": ["n"]})


def test_a_second_run_of_the_same_data_loads_it_and_a_change_prepares_again(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_GPU_TRAIN_CACHE", str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    cfg = load_config(None, ["max_train_samples=8"])
    key = data_key(cfg.values(), {"train": None}, None)
    built: list = []
    first = prepare_once(key, lambda: _built(built))
    again = prepare_once(key, lambda: _built(built))
    assert len(built) == 1 and again.train["x"] == first.train["x"] == [1, 2, 3] and again.meta == {"notes": ["n"]}
    assert "loaded from" in again.how and "prepared once" in first.how
    # what shapes the rows changes the key; what only changes training does not
    assert data_key(load_config(None, ["max_train_samples=9"]).values(), {"train": None}, None) != key
    assert data_key(load_config(None, ["max_train_samples=8", "learning_rate=1e-3", "output_dir=x"]).values(), {"train": None},
                    None) == key
    monkeypatch.setenv("WORLD_SIZE", "1")
    prepare_once(key, lambda: _built(built))
    assert len(built) == 2  # one process: built in the process, no cache read
