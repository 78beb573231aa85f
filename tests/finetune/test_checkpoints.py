import json

import pytest

from hf_gpu_train.finetune.checkpoints import COMPLETE_MARKER, check_label_map, last_complete_checkpoint
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
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[:2] == ["checkpoint-12", "checkpoint-16.incomplete-" + names[1].split("-")[-1]] or any(
        n.startswith("checkpoint-16.incomplete-") for n in names)
    assert "checkpoint-16" not in names  # set aside, not deleted, so the Trainer's rotation ignores it


def test_no_checkpoint(tmp_path):
    assert last_complete_checkpoint(tmp_path / "new") is None
    make_checkpoint(tmp_path, 2, complete=False)
    assert last_complete_checkpoint(tmp_path) is None


def test_label_map_mismatch_is_an_error(tmp_path):
    (tmp_path / "label_map.json").write_text(json.dumps(["cat", "dog"]))
    check_label_map(tmp_path, ["cat", "dog"], "output_dir")
    with pytest.raises(ConfigError, match=r"trained with labels \['cat', 'dog'\], this data has \['negative', 'positive'\]"):
        check_label_map(tmp_path, ["negative", "positive"], "output_dir")
