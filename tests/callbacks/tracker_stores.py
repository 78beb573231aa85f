"""Read what the trackers stored back from their own files, with their own formats (no mock of any tracker).

- TensorBoard: the event files (TFRecord framing of ``Event`` protobufs, tensorboardX's copy of TensorFlow's protos).
- Weights & Biases, offline: the run's ``run-<id>.wandb`` transaction log (LevelDB log framing of ``Record`` protobufs
  from ``wandb.proto.wandb_internal_pb2``; wandb 0.31 ships no Python reader for it, the framing is 30 lines).
- MLflow reads its own store: ``mlflow.tracking.MlflowClient(tracking_uri)`` in the tests.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path


def tensorboard_events(log_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, list[tuple[int, str]]]]:
    """(scalars, texts) from every event file under ``log_dir``: tag -> [(step, value)], text tag -> [(step, text)]."""
    from tensorboardX.proto.event_pb2 import Event

    scalars: dict[str, list[tuple[int, float]]] = {}
    texts: dict[str, list[tuple[int, str]]] = {}
    for path in sorted(Path(log_dir).rglob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at + 12 <= len(data):
            (length,) = struct.unpack_from("<Q", data, at)
            event = Event.FromString(data[at + 12:at + 12 + length])  # 8 length, 4 its crc, data, 4 crc
            at += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
                elif value.metadata.plugin_data.plugin_name == "text":
                    tag = value.tag.removesuffix("/text_summary")
                    texts.setdefault(tag, []).append((event.step, value.tensor.string_val[0].decode()))
    return scalars, texts


WANDB_HEADER = 7  # ":W&B", a 2-byte magic, a version byte
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    """The ``Record`` protobufs of an offline run's ``.wandb`` file, in order."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:8]
    records, at, pending = [], WANDB_HEADER, b""
    while at + 7 <= len(data):
        if BLOCK - at % BLOCK < 7:  # a block's tail too short for a header is padding
            at += BLOCK - at % BLOCK
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, at)
        chunk = data[at + 7:at + 7 + length]
        at += 7 + length
        if kind == 0 and length == 0:
            break
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            records.append(Record.FromString(pending))
    return records


def wandb_run(wandb_dir: Path) -> tuple[list[dict], dict]:
    """(history rows, summary) of the one offline run under ``wandb_dir``: each row and the summary key -> value."""
    (path,) = Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb")
    history, summary = [], {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
        elif kind == "summary":
            for item in record.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return history, summary
