"""Launched with 2 gloo processes by test_telemetry_ranks.py: rank 1 reads its data slowly. 6 steps of
2 x 8 samples are one epoch of the 96 samples, so the run's tokens are the data set's."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import Trainer  # noqa: E402

from hf_gpu_train.callbacks import attach_telemetry  # noqa: E402
from tests.callbacks.tiny import SlowOnRank1, tiny_args, tiny_bert  # noqa: E402

out = sys.argv[1]
trainer = Trainer(model=tiny_bert(), args=tiny_args(out, max_steps=6, logging_steps=2), train_dataset=SlowOnRank1(n=96))
attach_telemetry(trainer, interval_s=0.05, straggler_check_steps=1)  # named at step 4: steps 2, 3, 4 (step 1 left out)
trainer.train()

from hf_gpu_train.fast_exit import end_quickly  # noqa: E402
from hf_gpu_train.process_group import leave_process_group  # noqa: E402

end_quickly()  # seconds less per rank at exit (hf_gpu_train/fast_exit.py)

leave_process_group()  # Gloo's threads could otherwise abort the exit (see hf_gpu_train/process_group.py)
