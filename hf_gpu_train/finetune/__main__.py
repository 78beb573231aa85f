"""``python -m hf_gpu_train.finetune --config NAME_OR_PATH [key=value ...]``, and with several processes
``accelerate launch -m hf_gpu_train.finetune ...`` (or ``hf-gpu-train launch --config-file F -m hf_gpu_train.finetune
...``): what ``scripts/finetune.py`` runs, from an installed package. NAME: a shipped recipe (``hf-gpu-train finetune
--help`` lists them)."""

from hf_gpu_train.finetune.run import main
from hf_gpu_train.process_group import exit_process

if __name__ == "__main__":
    exit_process(main(prog="python -m hf_gpu_train.finetune"))  # leaves the process group after a finished run
