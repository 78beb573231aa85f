"""Fine-tune a classifier with the Hugging Face Trainer: timm or transformers, one CPU to many GPUs.

    python scripts/finetune.py                                   # MiniLM on the built-in text set
    accelerate launch scripts/finetune.py --config minilm_text_demo learning_rate=3e-5
    hf-gpu-train launch --config-file launch_configs/box.yaml scripts/finetune.py --config my_recipe.yaml

--config: a shipped recipe's name (hf_gpu_train/finetune/recipes/) or a YAML file. The logic lives in
hf_gpu_train.finetune; this file stays thin. From a pip install: `hf-gpu-train finetune` or `python -m hf_gpu_train.finetune`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_gpu_train.finetune.run import main  # noqa: E402
from hf_gpu_train.launch.one_process import one_process_line  # noqa: E402
from hf_gpu_train.process_group import exit_process  # noqa: E402

if __name__ == "__main__":
    if (line := one_process_line()) is not None:  # accelerate launch started one process of several asked for
        print(line, flush=True)
    exit_process(main())  # leaves the process group after a finished run: Gloo's threads could otherwise abort the exit
