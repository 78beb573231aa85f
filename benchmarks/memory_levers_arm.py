"""One arm of memory_levers.py, in a process of its own: scripts/finetune.py's finetune() on the SmolLM2 recipe with the
arm's key=value, then this process's peak RSS (what the training process held at its most: the model, the optimizer,
the activations and the logits) and the seconds of train().

    memory_levers_arm.py OUT.json key=value ...
"""

import json
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_gpu_train.fast_exit import end_quickly  # noqa: E402
from hf_gpu_train.finetune.loading import load_config  # noqa: E402
from hf_gpu_train.finetune.run import finetune, parse_args  # noqa: E402

end_quickly()  # seconds less per rank at exit (hf_gpu_train/fast_exit.py)

out, overrides = Path(sys.argv[1]), sys.argv[2:]
cfg = load_config(*parse_args(["--config", "smollm2_lora_demo", *overrides]))
finetune(cfg)
summary = json.loads((Path(cfg.output_dir) / "run_summary.json").read_text())
import torch  # noqa: E402

cuda_peak = torch.cuda.max_memory_reserved() if torch.cuda.is_available() else None
out.write_text(json.dumps({"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cuda_peak_reserved": cuda_peak,
                           "train_seconds": summary["train_seconds"], "steps": summary["global_step"],
                           "eval_loss": summary.get("eval_loss")}))
