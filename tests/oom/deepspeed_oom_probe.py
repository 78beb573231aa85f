"""scripts/finetune.py with an out-of-memory error injected on rank 1 only, in the backward of optimizer step
``OOM_AT_STEP``'s first micro-batch (``OOMFaultInjector``, a real ``torch.OutOfMemoryError``). Everything else is the
real entry point, launched under the DeepSpeed config the test names."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import TrainerCallback  # noqa: E402

from hf_gpu_train.fast_exit import end_quickly  # noqa: E402
from hf_gpu_train.finetune import run  # noqa: E402
from hf_gpu_train.oom import OOMFaultInjector  # noqa: E402

end_quickly()


class InjectAt(TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        forwards_before = (int(os.environ["OOM_AT_STEP"]) - 1) * args.gradient_accumulation_steps
        OOMFaultInjector(max_batch=0, rank=1, phase="backward", times=1, start_after=forwards_before).install(model)


defaults = run.default_callbacks
run.default_callbacks = lambda cfg, labels: [*defaults(cfg, labels), InjectAt()]
sys.exit(run.main(sys.argv[1:]))
