"""scripts/finetune.py with one callback more: when training begins, each rank writes what accelerate runs and whether
the model it trains is really sharded (FSDP2 turns parameters into DTensors holding a slice each)."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from transformers import TrainerCallback  # noqa: E402

from hf_gpu_train.finetune import run  # noqa: E402
from hf_gpu_train.process_group import exit_process  # noqa: E402


class ShardProbe(TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from accelerate.state import AcceleratorState
        from torch.distributed.tensor import DTensor

        params = list(model.parameters())
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
        rank = int(os.environ.get("RANK", "0"))
        with open(os.path.join(os.environ["PROBE_OUT"], f"rank{rank}.json"), "w") as f:
            json.dump({
                "rank": rank,
                "world_size": int(os.environ.get("WORLD_SIZE", "1")),
                "distributed_type": str(AcceleratorState().distributed_type),
                "model_class": type(model).__name__,
                "dtensor_params": sum(isinstance(p, DTensor) for p in params),
                "params": len(params),
                "local_numel": local,
                "global_numel": sum(p.numel() for p in params),
                "per_device_train_batch_size": args.per_device_train_batch_size,
            }, f)


finetune = run.finetune
run.finetune = lambda cfg, **kw: finetune(cfg, extra_callbacks=[ShardProbe()], **kw)

if __name__ == "__main__":
    exit_process(run.main(sys.argv[1:]))
