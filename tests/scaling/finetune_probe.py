"""Launched with several processes: ``scripts/finetune.py``'s ``main`` for each argument list in turn."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_gpu_train.fast_exit import end_quickly  # noqa: E402
from hf_gpu_train.finetune.run import main  # noqa: E402
from hf_gpu_train.process_group import leave_process_group  # noqa: E402

end_quickly()  # seconds less per rank at exit (hf_gpu_train/fast_exit.py)

for arguments in json.loads(sys.argv[1]):
    code = main(arguments)
    if code:
        sys.exit(code)
leave_process_group()
