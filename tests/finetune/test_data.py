import json

import pytest
from PIL import Image

from hf_gpu_train.finetune.builtin import make_text_examples
from hf_gpu_train.finetune.config import ConfigError
from hf_gpu_train.finetune.loading import load_config
from hf_gpu_train.finetune.tasks.classification import load_classification_data

ROWS = [{"text": f"sample {i} {'good' if i % 3 else 'bad'}", "other": f"pair {i}", "label": ["neg", "pos", "mid"][i % 3]}
        for i in range(60)]


def write(path, rows, kind):
    if kind == "csv":
        import csv

        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    elif kind == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows))
    elif kind == "json":
        path.write_text(json.dumps(rows))
    elif kind == "parquet":
        import pandas as pd

        pd.DataFrame(rows).to_parquet(path)
    return path


@pytest.mark.parametrize("kind", ["csv", "jsonl", "json", "parquet"])
def test_local_files_with_string_labels_and_carved_validation(tmp_path, kind):
    train = write(tmp_path / f"train.{kind}", ROWS, kind)
    cfg = load_config(None, [f"train_file={train}", "dataset=none", "validation_fraction=0.25"])
    data = load_classification_data(cfg)
    assert data.label_names == ["mid", "neg", "pos"]
    assert len(data.train) == 45 and len(data.validation) == 15
    assert set(data.validation["labels"]) == {0, 1, 2}  # stratified
    again = load_classification_data(cfg)
    assert again.validation["text"] == data.validation["text"]  # seeded


def test_validation_file_int_labels_and_text_pairs(tmp_path):
    rows = [{"a": f"s{i}", "b": f"t{i}", "y": i % 4} for i in range(40)]
    train = write(tmp_path / "t.csv", rows, "csv")
    dev = write(tmp_path / "d.csv", rows[:8], "csv")
    cfg = load_config(None, [f"train_file={train}", f"validation_file={dev}", "text_column=a", "text_pair_column=b", "label_column=y"])
    data = load_classification_data(cfg)
    assert data.label_names == ["0", "1", "2", "3"] and len(data.validation) == 8
    assert data.train["labels"][:4] == [0, 1, 2, 3]


def test_a_dataset_directory_goes_through_load_dataset(tmp_path):
    folder = tmp_path / "my_dataset"
    folder.mkdir()
    write(folder / "train.csv", ROWS, "csv")
    write(folder / "test.csv", ROWS[:9], "csv")
    data = load_classification_data(load_config(None, [f"dataset={folder}"]))
    assert len(data.train) == 60 and len(data.validation) == 9  # the "test" split is used for validation


@pytest.mark.parametrize("overrides, rows, pattern", [
    (["label_column=category"], ROWS, r"label_column='category' is not a column of the train split; its columns are \['text', 'other', 'label'\]"),
    (["text_column=sentence"], ROWS, "text_column='sentence'"),
    ([], [{"text": f"x{i}", "label": "only"} for i in range(10)], "single class"),
    ([], [{"text": f"x{i}", "label": i / 3} for i in range(10)], "non-integer"),
])
def test_data_errors(tmp_path, overrides, rows, pattern):
    train = write(tmp_path / "t.jsonl", rows, "jsonl")
    with pytest.raises(ConfigError, match=pattern):
        load_classification_data(load_config(None, [f"train_file={train}", *overrides]))


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_classification_data(load_config(None, [f"train_file={tmp_path / 'none.csv'}"]))
    with pytest.raises(ConfigError, match="unsupported file type"):
        (tmp_path / "x.txt").write_text("hi")
        load_classification_data(load_config(None, [f"train_file={tmp_path / 'x.txt'}"]))
    empty = tmp_path / "e.csv"
    empty.write_text("text,label\n")
    dev = write(tmp_path / "d.csv", ROWS, "csv")
    with pytest.raises(ConfigError, match="empty"):
        load_classification_data(load_config(None, [f"train_file={empty}", f"validation_file={dev}"]))


def test_validation_label_unknown_to_training(tmp_path):
    train = write(tmp_path / "t.csv", ROWS, "csv")
    dev = write(tmp_path / "d.csv", [{"text": "x", "other": "y", "label": "surprise"}], "csv")
    with pytest.raises(ConfigError, match="'surprise'"):
        load_classification_data(load_config(None, [f"train_file={train}", f"validation_file={dev}"]))


def make_imagefolder(root, broken=False):
    for label, color in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
        (root / label).mkdir(parents=True)
        for i in range(6):
            Image.new("RGB", (16, 16), color).save(root / label / f"{i}.png")
    if broken:
        (root / "dog" / "broken.png").write_bytes(b"not a png at all")
    return root


def test_imagefolder_and_unreadable_images(tmp_path):
    good = make_imagefolder(tmp_path / "good")
    data = load_classification_data(load_config(None, ["task=image-classification", f"dataset=imagefolder:{good}"]))
    assert data.label_names == ["cat", "dog"] and len(data.train) + len(data.validation) == 12
    bad = make_imagefolder(tmp_path / "bad", broken=True)
    with pytest.raises(ConfigError, match="unreadable image .*broken.png"):
        load_classification_data(load_config(None, ["task=image-classification", f"dataset=imagefolder:{bad}"]))


def test_builtin_sets():
    rows = make_text_examples()
    assert rows == make_text_examples() and len(rows) == 2400
    assert {r["label"] for r in rows} == {"negative", "positive"}
    assert any(" not " in r["text"] and r["label"] == "positive" for r in rows)  # negation flips
    digits = load_classification_data(load_config(None, ["task=image-classification", "dataset=builtin:digits"]))
    assert digits.label_names == [str(i) for i in range(10)] and len(digits.train) + len(digits.validation) == 1797


def rows_of(counts: dict[str, int]) -> list[dict]:
    return [{"text": f"{label} example {i}", "label": label} for label, n in counts.items() for i in range(n)]


def class_counts(ds, names) -> dict[str, int]:
    from collections import Counter

    return {names[i]: n for i, n in sorted(Counter(ds["labels"]).items())}


def test_four_rows_two_classes_carve_one_of_each_and_say_so(tmp_path):
    train = write(tmp_path / "t.jsonl", rows_of({"neg": 2, "pos": 2}), "jsonl")
    data = load_classification_data(load_config(None, [f"train_file={train}"]))
    assert class_counts(data.train, data.label_names) == {"neg": 1, "pos": 1}
    assert class_counts(data.validation, data.label_names) == {"neg": 1, "pos": 1}
    assert any("2 of 4 rows (50%" in note and "validation_fraction=0.2" in note for note in data.notes)


def test_a_class_with_one_row_cannot_be_carved_and_the_error_names_the_minimum(tmp_path):
    train = write(tmp_path / "t.jsonl", rows_of({"neg": 2, "pos": 1}), "jsonl")
    with pytest.raises(ConfigError, match=r"class 'pos' has 1 row.*at least 2 rows in every class.*validation_file="):
        load_classification_data(load_config(None, [f"train_file={train}"]))


def test_a_rare_class_keeps_a_row_on_both_sides(tmp_path):
    # datasets' stratified train_test_split left 'rare_b' out of validation here (20 validation rows for 104: 20/0/1)
    train = write(tmp_path / "t.jsonl", rows_of({"common": 100, "rare_a": 2, "rare_b": 2}), "jsonl")
    data = load_classification_data(load_config(None, [f"train_file={train}"]))
    assert class_counts(data.validation, data.label_names) == {"common": 20, "rare_a": 1, "rare_b": 1}
    assert class_counts(data.train, data.label_names) == {"common": 80, "rare_a": 1, "rare_b": 1}


def test_no_note_when_the_carve_is_what_was_asked(tmp_path):
    train = write(tmp_path / "t.csv", ROWS, "csv")
    data = load_classification_data(load_config(None, [f"train_file={train}", "dataset=none", "validation_fraction=0.25"]))
    assert data.notes == []


def test_max_train_samples_draws_from_every_class_of_a_sorted_file(tmp_path):
    train = write(tmp_path / "t.jsonl", rows_of({"neg": 50, "pos": 50}), "jsonl")  # sorted by class, like an imagefolder
    dev = write(tmp_path / "d.jsonl", rows_of({"neg": 5, "pos": 5}), "jsonl")
    data = load_classification_data(load_config(None, [f"train_file={train}", f"validation_file={dev}", "max_train_samples=10",
                                                      "max_eval_samples=4"]))
    assert len(data.train) == 10 and set(class_counts(data.train, data.label_names)) == {"neg", "pos"}
    assert len(data.validation) == 4 and set(class_counts(data.validation, data.label_names)) == {"neg", "pos"}


def test_too_small_to_carve_exits_2_with_one_line_before_anything_is_written(tmp_path, capsys):
    from hf_gpu_train.finetune.run import main

    train = write(tmp_path / "t.csv", rows_of({"neg": 3, "pos": 1}), "csv")
    assert main(["dataset=none", f"train_file={train}", f"output_dir={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert "class 'pos' has 1 row" in err and "at least 2 rows in every class" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
