import json

import pytest

from hf_gpu_train.finetune.checkpoints import COMPLETE_MARKER, SET_ASIDE_DIR, check_label_map, last_complete_checkpoint
from hf_gpu_train.finetune.config import ConfigError


def make_checkpoint(root, step, complete):
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"x")
    if complete:
        (path / "trainer_state.json").write_text("{}")
        (path / COMPLETE_MARKER).write_text("{}")
    return path


def test_an_interrupted_save_is_never_taken_for_a_complete_one(tmp_path):
    make_checkpoint(tmp_path, 4, complete=True)
    make_checkpoint(tmp_path, 12, complete=True)
    make_checkpoint(tmp_path, 16, complete=False)  # killed mid-save: no marker
    assert last_complete_checkpoint(tmp_path).name == "checkpoint-12"
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-4"]  # what the Trainer rotates
    aside = list((tmp_path / SET_ASIDE_DIR).iterdir())  # set aside, not deleted, out of the Trainer's sight
    assert len(aside) == 1 and aside[0].name.startswith("checkpoint-16.") and (aside[0] / "model.safetensors").read_bytes() == b"x"


def test_no_checkpoint(tmp_path):
    assert last_complete_checkpoint(tmp_path / "new") is None
    make_checkpoint(tmp_path, 2, complete=False)
    assert last_complete_checkpoint(tmp_path) is None


def test_label_map_mismatch_is_an_error(tmp_path):
    (tmp_path / "label_map.json").write_text(json.dumps(["cat", "dog"]))
    check_label_map(tmp_path, ["cat", "dog"], "output_dir")
    with pytest.raises(ConfigError, match=r"trained with labels \['cat', 'dog'\], this data has \['negative', 'positive'\]"):
        check_label_map(tmp_path, ["negative", "positive"], "output_dir")
