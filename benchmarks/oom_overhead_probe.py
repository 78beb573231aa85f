"""One DDP training run for oom_overhead.py: MiniLM on the built-in text set, with or without recovery."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from telemetry_overhead import build  # noqa: E402

from hf_gpu_train.training import enable_oom_recovery  # noqa: E402

out, mode, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
trainer = build(f"{out}/{mode}", steps, logging_steps=10, on_cuda=False)
if mode == "recovery":
    enable_oom_recovery(trainer)
result = trainer.train()
if trainer.is_world_process_zero():
    Path(out, f"{mode}.json").write_text(json.dumps({"steps_per_second": result.metrics["train_steps_per_second"]}))
