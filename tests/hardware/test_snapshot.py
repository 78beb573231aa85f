import json

import pytest

from hf_gpu_train.errors import UsageError
from hf_gpu_train.hardware import snapshot
from hf_gpu_train.hardware.snapshot import SnapshotError, from_dict, load, load_machine, save, to_dict
from tests.conftest import REFERENCE_MACHINES


@pytest.mark.parametrize("name", REFERENCE_MACHINES)
def test_json_round_trip(tmp_path, name):
    original = load_machine(name)
    path = save(original, tmp_path / "m.json")
    assert load(path) == original
    assert load_machine(str(path)) == original


def test_errors_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(SnapshotError, match="does not exist"):
        load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SnapshotError, match="not valid JSON"):
        load(bad)
    bad.write_text(json.dumps({"hello": 1}))
    with pytest.raises(SnapshotError, match="detect --save"):
        load(bad)
    data = to_dict(load_machine("1x-t4"))
    data["version"] = 99
    with pytest.raises(SnapshotError, match="version 99"):
        from_dict(data)
    data["version"] = snapshot.VERSION
    data["profile"]["gpus"][0]["flux_capacitor"] = 1
    with pytest.raises(SnapshotError, match="flux_capacitor"):
        from_dict(data)


def test_version_1_snapshots_still_load_with_mig_facts_unknown():
    data = to_dict(load_machine("2x-a100-one-busy"))
    data["version"] = 1
    for gpu in data["profile"]["gpus"]:  # version 1 had neither field
        del gpu["mig_pending_enabled"], gpu["mig_instances"], gpu["health"]
    old = from_dict(data)
    assert [(g.mig_enabled, g.mig_pending_enabled, g.mig_instances) for g in old.gpus] == [(False, None, None)] * 2
    assert not any(g.mig_change_pending for g in old.gpus)
    assert to_dict(old)["version"] == snapshot.VERSION == 3


def test_mig_instances_round_trip(tmp_path):
    original = load_machine("1x-a100-mig")
    assert load(save(original, tmp_path / "m.json")).gpus[0].mig_instances == original.gpus[0].mig_instances
    assert len(original.gpus[0].mig_instances) == 2


def test_unknown_machine_name_suggests_the_nearest():
    with pytest.raises(UsageError, match="'8x-h100-sxm'"):
        load_machine("8x-h100")


def test_save_is_atomic_and_leaves_no_temp_file(tmp_path):
    path = save(load_machine("1x-t4"), tmp_path / "sub" / "box.json")
    assert [p.name for p in path.parent.iterdir()] == ["box.json"]
