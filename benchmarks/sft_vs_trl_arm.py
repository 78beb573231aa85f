"""One arm of benchmarks/sft_vs_trl.py in its own process (so its peak RSS is its own), or the common evaluation.

    python benchmarks/sft_vs_trl_arm.py SPEC.json

SPEC holds ``mode`` ("train" or "eval") and what the parent decided; the result goes to ``spec["result"]`` as JSON.

Training arms: ``ours`` (``hf_gpu_train.finetune.run.finetune`` on the demo recipe, every default of ours on) or
``trl*`` (TRL's ``SFTTrainer`` with the options the parent passes). Both trainers get the same measuring mixin:

- real tokens: the training dataloader's collator is wrapped to add the number of tokens of the rows it was given
  (ours: packed rows, their tokens without the batch's padding; TRL: examples, or its packed rows) under a private
  key, which ``get_batch_samples`` (main process, before any training step) pops and adds up per optimizer step;
- training time: the wall time of ``trainer.train()``, less the evaluations and checkpoints run inside it (ours
  evaluates and saves on a timer; TRL's defaults do neither in a short run); also the time to the first optimizer
  step's end, so a steady rate without the first step (CUDA and allocator warm-up) can be given;
- peak memory: on the CPU the process RSS sampled every 20 ms during ``train()`` (psutil) and the process's
  ``ru_maxrss`` (loading and tokenizing included); on a GPU ``torch.cuda.max_memory_reserved`` over ``train()`` (and allocated, and what the device holds outside torch).

The common evaluation loads the base model once in fp32 and each saved adapter onto it, and computes, over the same
validation conversations tokenized the same way (the chat template, as both tools render it): the mean token
cross-entropy on the assistant turns (answer and end-of-turn token: the completion-only definition) and on every token
after the first (the full-sequence definition, TRL's default for ``messages`` data).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import threading
import time
from pathlib import Path

from hf_gpu_train.fast_exit import end_quickly  # noqa: E402

end_quickly()  # seconds less per rank at exit (hf_gpu_train/fast_exit.py)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOKENS_KEY = "_bench_real_tokens"
SAMPLE_SECONDS = 0.02


class CountingCollator:
    """The trainer's collator, plus the number of real (non-padding) tokens of the rows it batched."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, rows):
        batch = self.inner(rows)
        batch[TOKENS_KEY] = sum(len(row["input_ids"]) for row in rows)
        return batch


class PeakRSS:
    """The process RSS, sampled by a thread while it runs."""

    def __init__(self):
        import psutil

        self.process = psutil.Process()
        self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(SAMPLE_SECONDS):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)


def _outside_torch() -> int:
    """What the device holds beyond torch's reservation (the CUDA context, other processes): what tune's measured peak
    adds to torch's peak reserved (callbacks/devices.device_peak)."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return max(0, (total - free) - torch.cuda.memory_reserved())


LAST = {}  # the measures of the last train() in this process


def measured(trainer_class):
    """``trainer_class`` with the measures above; the trained model stays reachable through ``LAST``."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self, owner):
            self.owner = owner

        def on_step_end(self, args, state, control, **kwargs):
            m = self.owner._bench
            m["steps"].append((time.perf_counter() - m["start"] - m["excluded"], m["tokens"]))
            return control

    class Measured(trainer_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._bench = None
            self.add_callback(StepClock(self))

        def get_train_dataloader(self):
            inner = self.data_collator
            self.data_collator = CountingCollator(inner)
            try:
                return super().get_train_dataloader()
            finally:
                self.data_collator = inner

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            batches, items = super().get_batch_samples(epoch_iterator, num_batches, device)
            for batch in batches:
                self._bench["tokens"] += int(batch.pop(TOKENS_KEY, 0))
            return batches, items

        def _excluded(self, call, *args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                if self._bench is not None and self._bench["running"]:
                    self._bench["excluded"] += time.perf_counter() - start

        def evaluate(self, *args, **kwargs):
            return self._excluded(super().evaluate, *args, **kwargs)

        def _save_checkpoint(self, *args, **kwargs):
            return self._excluded(super()._save_checkpoint, *args, **kwargs)

        def train(self, *args, **kwargs):
            import torch

            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self._bench = {"tokens": 0, "excluded": 0.0, "steps": [], "running": True, "start": time.perf_counter()}
            with PeakRSS() as rss:
                rss_at_start = rss.peak  # what the process holds before the first step: libraries, model, data
                try:
                    result = super().train(*args, **kwargs)
                    if cuda:
                        torch.cuda.synchronize()
                finally:
                    self._bench["running"] = False
                    self._bench["wall"] = time.perf_counter() - self._bench["start"]
            m = self._bench
            LAST.update(
                trainer=self, tokens=m["tokens"], wall_seconds=m["wall"], excluded_seconds=m["excluded"],
                train_seconds=m["wall"] - m["excluded"], step_marks=m["steps"], optimizer_steps=self.state.global_step,
                peak_rss_train=rss.peak, rss_at_train_start=rss_at_start, ru_maxrss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                cuda_peak_allocated=torch.cuda.max_memory_allocated() if cuda else None,
                cuda_peak_reserved=torch.cuda.max_memory_reserved() if cuda else None,
                cuda_outside_torch=_outside_torch() if cuda else None,
                train_loss=result.training_loss)
            return result

    Measured.__name__ = f"Measured{trainer_class.__name__}"
    return Measured


# -- arms ---------------------------------------------------------------------------------------------------------

def run_ours(spec: dict) -> dict:
    import yaml
    from transformers import Trainer

    from hf_gpu_train.finetune.launch_plan import apply_launch_plan
    from hf_gpu_train.finetune.loading import load_config_and_keys
    from hf_gpu_train.finetune.run import finetune
    from hf_gpu_train.plan.run_plan_file import PLAN_ENV

    cfg, explicit = load_config_and_keys(spec["recipe"], spec["ours_overrides"])
    applied = None
    if spec.get("plan_file"):  # ours-lean: the plan `hf-gpu-train tune` wrote, applied as scripts/finetune.py applies it
        os.environ[PLAN_ENV] = spec["plan_file"]
        cfg, applied = apply_launch_plan(cfg, explicit, recipe=spec["recipe"], overrides=spec["ours_overrides"])
        print("\n".join(applied.lines), flush=True)
    metrics = finetune(cfg, trainer_class=measured(Trainer), launch_plan=applied)
    ran = yaml.safe_load((Path(cfg.output_dir) / "finetune_config.yaml").read_text())
    levers = {k: ran.get(k) for k in ("per_device_train_batch_size", "gradient_checkpointing", "checkpoint_layers", "chunked_lm_loss",
                                      "offload_activations", "packing", "dataloader_num_workers")}
    return {"adapter": cfg.output_dir, "own_eval_loss": metrics.get("eval_loss"), "levers": levers,
            "own_eval_loss_definition": "ours: assistant tokens of the packed validation rows"}


def run_trl(spec: dict) -> dict:
    import datasets
    import torch
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    s = spec["trl"]
    on_cuda = torch.cuda.is_available()
    options = dict(
        output_dir=spec["out"], seed=s["seed"],
        # the comparison's common settings: same epochs (or steps), learning rate, schedule, warmup, weight decay
        num_train_epochs=s["num_train_epochs"], max_steps=s["max_steps"], learning_rate=s["learning_rate"],
        lr_scheduler_type=s["lr_scheduler_type"], warmup_steps=s["warmup_ratio"], weight_decay=s["weight_decay"],
        max_length=s["max_length"], per_device_train_batch_size=s["batch"],
        report_to="none", save_strategy="no",
    )
    options.update(s.get("options", {}))  # packing, gradient_checkpointing, bf16 where the arm says
    if not on_cuda and "bf16" not in s.get("options", {}):
        options["bf16"] = False  # fp32 on a CPU without bf16 units, as an expert sets it (TRL's default is bf16)
    elif not on_cuda:
        options["use_cpu"] = True  # bf16 on a machine without a GPU: transformers refuses it unless use_cpu=True
    if on_cuda and s.get("model_dtype") == "bfloat16":
        options["model_init_kwargs"] = {"dtype": "bfloat16"}
    config = SFTConfig(**options)
    train = datasets.load_dataset("json", data_files=spec["train_file"], split="train")
    peft_config = LoraConfig(r=s["lora_r"], lora_alpha=s["lora_alpha"], lora_dropout=s["lora_dropout"],
                             target_modules=s["lora_target_modules"], task_type="CAUSAL_LM")
    trainer = measured(SFTTrainer)(model=spec["model_path"], args=config, train_dataset=train, peft_config=peft_config)
    trainer.train()
    adapter = str(Path(spec["out"]) / "adapter")
    trainer.save_model(adapter)
    return {"adapter": adapter, "settings": {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v))
                                             for k, v in options.items()},
            "gradient_checkpointing": bool(config.activation_checkpointing), "bf16": bool(config.bf16),
            "packing": bool(config.packing), "padding_free": bool(trainer.padding_free),
            "completion_only_loss": bool(trainer.completion_only_loss)}


def train_arm(spec: dict) -> dict:
    import torch

    load_start = os.getloadavg()[0]
    out = run_ours(spec) if spec["arm"].startswith("ours") else run_trl(spec)
    m = LAST
    marks = m["step_marks"]
    first_seconds, first_tokens = marks[0] if marks else (m["train_seconds"], m["tokens"])
    steady_seconds = m["train_seconds"] - first_seconds
    return {**out, "arm": spec["arm"], "tokens": m["tokens"], "optimizer_steps": m["optimizer_steps"],
            "train_seconds": m["train_seconds"], "wall_seconds": m["wall_seconds"], "excluded_seconds": m["excluded_seconds"],
            "tokens_per_second": m["tokens"] / m["train_seconds"],
            "steady_tokens_per_second": (m["tokens"] - first_tokens) / steady_seconds if len(marks) > 1 and steady_seconds > 0 else None,
            "first_step_seconds": first_seconds, "peak_rss_train": m["peak_rss_train"], "ru_maxrss": m["ru_maxrss"],
            "rss_at_train_start": m["rss_at_train_start"],
            "cuda_peak_allocated": m["cuda_peak_allocated"], "cuda_peak_reserved": m["cuda_peak_reserved"],
            "cuda_outside_torch": m["cuda_outside_torch"], "train_loss": m["train_loss"],
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "load_average_1min": [load_start, os.getloadavg()[0]],  # other jobs on the machine, at the start and end
            "torch_threads": torch.get_num_threads()}


# -- the common evaluation ----------------------------------------------------------------------------------------

def encode_validation(tokenizer, rows: list[dict], max_length: int) -> list[tuple[list[int], list[bool]]]:
    """(token ids, is-assistant per token) per conversation: the chat template's rendering, assistant spans found
    by rendering prefixes (answer + end-of-turn token), truncated to max_length."""
    from hf_gpu_train.finetune.tasks.language_modeling.chat import assistant_spans, labels_from_spans

    out = []
    for row in rows:
        messages = row["messages"]
        trained = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        text, spans = assistant_spans(tokenizer, messages, trained)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = labels_from_spans(enc["offset_mapping"], spans)
        out.append((enc["input_ids"][:max_length], mask[:max_length]))
    return out


def evaluate_model(model, examples, device, batch: int = 8) -> dict:
    """Sums over every target token, so the batching (examples sorted by length: little padding) changes nothing."""
    import torch

    examples = sorted(examples, key=lambda e: len(e[0]))
    sums = {"assistant": 0.0, "all": 0.0}
    counts = {"assistant": 0, "all": 0}
    model.eval()
    for start in range(0, len(examples), batch):
        chunk = examples[start:start + batch]
        width = max(len(ids) for ids, _ in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        attention = torch.zeros((len(chunk), width), dtype=torch.long)
        assistant = torch.zeros((len(chunk), width), dtype=torch.bool)
        for r, (x, mask) in enumerate(chunk):
            ids[r, :len(x)] = torch.tensor(x)
            attention[r, :len(x)] = 1
            assistant[r, :len(x)] = torch.tensor(mask)
        ids, attention, assistant = ids.to(device), attention.to(device), assistant.to(device)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
        targets = {"assistant": assistant[:, 1:] & attention[:, 1:].bool(), "all": attention[:, 1:].bool()}
        for key, mask in targets.items():
            sums[key] += float(nll[mask].sum())
            counts[key] += int(mask.sum())
    return {f"eval_loss_{k}": sums[k] / counts[k] for k in sums} | {f"eval_tokens_{k}": counts[k] for k in counts}


def common_eval(spec: dict) -> dict:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    rows = [json.loads(line) for line in Path(spec["validation_file"]).read_text().splitlines() if line.strip()]
    examples = encode_validation(tokenizer, rows, spec["max_length"])
    results = {}
    for name, adapter in [("base", None), *spec["adapters"].items()]:
        model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=torch.float32).to(device)
        if adapter:
            model = PeftModel.from_pretrained(model, adapter).to(device)
        results[name] = evaluate_model(model, examples, device)
        del model
    return {"results": results, "validation_rows": len(rows), "precision": "fp32", "device": device}


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    os.chdir(ROOT)
    if spec.get("release_memory"):  # the allocator setting of ours' release_memory=true, for a like-for-like arm
        from hf_gpu_train.levers.release_memory import release

        print(release(on_cuda=bool(__import__("torch").cuda.is_available())), flush=True)
    result = train_arm(spec) if spec["mode"] == "train" else common_eval(spec)
    Path(spec["result"]).write_text(json.dumps(result, indent=2, default=lambda v: None if isinstance(v, float) and math.isnan(v) else str(v)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
