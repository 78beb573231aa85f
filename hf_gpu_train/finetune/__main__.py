"""``python -m hf_gpu_train.finetune --config NAME_OR_PATH [key=value ...]``, and with several processes
``accelerate launch -m hf_gpu_train.finetune ...`` (or ``hf-gpu-train launch --config-file F -m hf_gpu_train.finetune
...``): what ``scripts/finetune.py`` runs, from an installed package. NAME: a shipped recipe (``hf-gpu-train finetune
--help`` lists them). Started alone by ``accelerate launch`` while more processes were asked for (or none: accelerate's
default), it says so in one line first (``launch/one_process.py``)."""

from hf_gpu_train.finetune.run import main
from hf_gpu_train.launch.one_process import one_process_line
from hf_gpu_train.process_group import exit_process

if __name__ == "__main__":
    if (line := one_process_line()) is not None:
        print(line, flush=True)
    exit_process(main(prog="python -m hf_gpu_train.finetune"))  # leaves the process group after a finished run
