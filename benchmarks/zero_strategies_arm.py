"""One arm of zero_strategies.py: scripts/finetune.py's entry point with the arm's key=value, in this process (one rank of a
launch, or the one process), then this rank's peak RSS (``ru_maxrss``: loading included), its largest private memory (USS) at the end of a training step, freed
memory given back to the system first (the model, its gradients and optimizer state as this rank holds them) and the run's seconds in ``train()``.

    zero_strategies_arm.py OUT_DIR key=value ...      (writes OUT_DIR/rank{RANK}.json)
"""

import json
import os
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from hf_gpu_train.c_library import c_function  # noqa: E402
from hf_gpu_train.fast_exit import end_quickly  # noqa: E402
from hf_gpu_train.finetune import run  # noqa: E402
from hf_gpu_train.process_group import exit_process  # noqa: E402

end_quickly()
out, overrides = Path(sys.argv[1]), sys.argv[2:]


TRIM = c_function("malloc_trim")


class StepMemory(TrainerCallback):
    """The largest private memory (USS: no file pages a checkpoint's mapping left) at a step's end, with the memory
    the allocator holds freed given back first (glibc's ``malloc_trim``): the training state as this rank holds it,
    without what loading left behind (every rank reads the whole checkpoint before any strategy shards it)."""

    peak = 0

    def on_step_end(self, args, state, control, **kwargs):
        if TRIM is not None:
            TRIM(0)
        StepMemory.peak = max(StepMemory.peak, psutil.Process().memory_full_info().uss)


defaults = run.default_callbacks
run.default_callbacks = lambda cfg, labels: [*defaults(cfg, labels), StepMemory()]
code = run.main(overrides)
if code == 0:
    rank = os.environ.get("RANK", "0")
    figures = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "step_rss_bytes": StepMemory.peak}
    if rank == "0":  # the run's summary is the main process's
        output_dir = Path(next(a.split("=", 1)[1] for a in overrides if a.startswith("output_dir=")))
        summary = json.loads((output_dir / "run_summary.json").read_text())
        figures.update(train_seconds=summary["train_seconds"], steps=summary["global_step"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(figures))
exit_process(code)
