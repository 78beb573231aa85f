"""One arm of oom_overhead.py or faults.py, launched on 2 gloo processes: ``scripts/finetune.py``'s ``finetune()`` as
shipped (MiniLM on builtin:text, the default when its figures were measured), short, with the arm's key=value and nothing else different.
A first ``recipe=NAME_OR_PATH`` (a shipped recipe's name, or a file) runs that recipe as shipped instead (no MiniLM pins).

    default_finetune_probe.py OUT NAME STEPS [recipe=NAME_OR_PATH] [key=value ...]   (writes OUT/NAME.json: the steps/s)
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_gpu_train.fast_exit import end_quickly  # noqa: E402
from hf_gpu_train.finetune.loading import load_config  # noqa: E402
from hf_gpu_train.finetune.run import finetune, parse_args  # noqa: E402
from hf_gpu_train.process_group import leave_process_group  # noqa: E402

end_quickly()  # seconds less per rank at exit (hf_gpu_train/fast_exit.py)

# the defaults its figures were measured with (docs/oom-recovery.md, docs/faults.md), before the default run moved to
# builtin:python-docs with a learning rate by model and an evaluation first
PINNED = ("dataset=builtin:text", "learning_rate=5e-5", "evaluate_before=false")
out, name, steps, arm = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
recipe = arm.pop(0).split("=", 1)[1] if arm and arm[0].startswith("recipe=") else None
shape = [] if recipe else ["per_device_train_batch_size=16", "max_length=64", *PINNED]
recipe, files = parse_args(["--config", recipe]) if recipe else (None, [])  # a name -> the shipped recipe
cfg = load_config(recipe, [*files, f"output_dir={out}/{name}", f"max_steps={steps}", "logging_steps=10", "eval_strategy=no",
                           "save_strategy=no", "telemetry=false", "resume=never", *shape, *arm])
finetune(cfg)
if os.environ.get("RANK", "0") == "0":  # rank 0 writes the run summary
    summary = json.loads(Path(out, name, "run_summary.json").read_text())
    figures = {"steps_per_second": summary["global_step"] / summary["train_seconds"]}
    state = Path(out, name, "trainer_state.json")
    if state.is_file():  # telemetry on, logging every step: the steps after the first two, without one-time costs
        times = [h["loop/step_time_s"] for h in json.loads(state.read_text())["log_history"] if "loop/step_time_s" in h]
        if len(times) > 3:
            figures["steady_steps_per_second"] = (len(times) - 2) / sum(times[2:])
    from hf_gpu_train.oom.lockstep import COST  # the recovery's own work, per optimizer step

    figures["recovery_cost_per_step_s"] = {k: v / summary["global_step"] for k, v in COST.as_dict().items()}
    Path(out, f"{name}.json").write_text(json.dumps(figures))
leave_process_group()  # Gloo's threads could otherwise abort the exit
