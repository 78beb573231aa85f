"""A simulated machine for the search: throughput and memory as plain functions of a candidate, so the search
order, early stopping and the budget are tested exactly, without torch."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from hf_gpu_train.tune.candidates import Candidate, CandidateSpace, TuneInputs, plan_space
from hf_gpu_train.tune.results import OK, OOM, TrialResult


@dataclass
class Machine:
    """``oom_above``: the largest micro-batch that fits without checkpointing (``ckpt_factor`` times more with it);
    speed saturates with the micro-batch (``half_speed_micro``); checkpointing costs ``ckpt_cost``; ``data_wait``
    per worker count (share of step time waiting for data), which slows the step by that share."""

    oom_above: int = 12
    ckpt_factor: int = 4
    half_speed_micro: float = 4.0
    ckpt_cost: float = 0.25
    data_wait: tuple[tuple[int, float], ...] = ((0, 0.0),)
    fp16_gain: float = 0.0
    trial_seconds: float = 5.0
    jitter: float = 0.0  # each measured step's time off by up to this fraction, differently in every trial
    steps: int = 8
    calls: list = field(default_factory=list)
    # other checkpointing policies (selective, every-N): their factor and cost; "all" is ckpt_factor and ckpt_cost
    policies: dict = field(default_factory=dict)
    offload: tuple[float, float] = (2.0, 0.2)  # activation offloading: factor on the limit, cost
    gib_per_sample: float = 0.0  # the peak a trial measures, in GiB per sample of micro-batch (0: none measured)

    def factor(self, c: Candidate) -> float:
        factor = (self.policies.get(c.checkpoint_layers, (self.ckpt_factor,))[0] if c.gradient_checkpointing else 1)
        return factor * (self.offload[0] if c.offload_activations else 1)

    def limit(self, c: Candidate) -> int:
        return int(self.oom_above * self.factor(c))

    def cost(self, c: Candidate) -> float:
        cost = self.policies.get(c.checkpoint_layers, (None, self.ckpt_cost))[1] if c.gradient_checkpointing else 0.0
        return 1 - (1 - cost) * (1 - (self.offload[1] if c.offload_activations else 0.0))

    def run(self, c: Candidate, warmup: int = 2, measure: int = 4) -> TrialResult:
        self.calls.append(c)
        limit = self.limit(c)
        speed = 1000.0 * c.micro_batch / (c.micro_batch + self.half_speed_micro)
        speed *= 1 - self.cost(c)
        speed *= (1 + self.fp16_gain) if c.precision == "fp16" else 1.0
        wait = dict(self.data_wait).get(c.dataloader_num_workers, 0.0)
        speed *= 1 - wait
        rng = random.Random(c.key)
        lengths = [1.0 + 0.5 * (i % 3) for i in range(self.steps)]  # the batches differ; every trial sees the same ones
        times = tuple(length / speed * (1 + rng.uniform(-self.jitter, self.jitter)) for length in lengths)
        speed = sum(lengths) / sum(times)
        common = dict(samples_per_s=speed, tokens_per_s=speed * 20, step_time_s=0.5, data_wait_pct=100 * wait,
                      warmup_steps=warmup, measured_steps=self.steps, step_times_s=times, seconds=self.trial_seconds,
                      peak_memory_bytes=int(c.micro_batch * self.gib_per_sample * 2**30 / self.factor(c)) if self.gib_per_sample else None)
        if c.micro_batch <= limit:
            return TrialResult(c, OK, **common)
        rescued, failed = c.micro_batch, None
        while rescued > limit:  # the OOM recovery halves until it fits
            failed, rescued = rescued, rescued // 2
        return TrialResult(c, OOM, "injected", rescued_micro_batch=rescued, failed_micro_batch=failed, **common)

def space(per_process: int = 32, start: int | None = None, world: int = 1, workers: int = 0, precision: str = "fp32",
          fixed: frozenset = frozenset(), on_cuda: bool = False, memory_check=None, axes=None, task: str = "text-classification",
          layered: bool = False, memory_budget_bytes: int | None = None, **values) -> CandidateSpace:
    v = {"per_device_train_batch_size": start or per_process, "global_batch_size": per_process * world,
         "gradient_checkpointing": False, "dataloader_num_workers": workers, "precision": precision, "torch_compile": False, **values}
    inputs = TuneInputs(values=v, fixed=fixed, task=task, world_size=world, on_cuda=on_cuda,
                        planned_micro_batch=start, planned_workers=workers, layered=layered, memory_budget_bytes=memory_budget_bytes)
    if axes is not None:
        inputs = replace(inputs, axes=axes)
    return plan_space(inputs, memory_check)
