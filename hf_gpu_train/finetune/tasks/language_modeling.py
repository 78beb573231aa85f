"""``task=causal-lm``: supervised fine-tuning of a causal language model (LoRA, QLoRA or full), on text or chat
rows, packed where the model's attention keeps examples apart, evaluated by its loss (perplexity), with generation
samples before and after training and the adapter merged at the end. The machinery is ``finetune/causal_lm/``."""

from __future__ import annotations

from pathlib import Path

from ...errors import ConfigError
from .base import Prepared, Task, register_task

# Full fine-tuning: 2e-5, TRL SFTConfig's default (a pretrained LM moves less than an encoder with a fresh head).
# LoRA/QLoRA: 2e-4, the QLoRA paper's rate for 7B-13B models (Dettmers et al. 2023, table 9); the adapters start at
# zero and have few parameters, so they take larger steps.
CAUSAL_LM_FULL_LEARNING_RATE = 2e-5
ADAPTER_LEARNING_RATE = 2e-4
CLASSIFIER_BUILTINS = ("builtin:minilm", "builtin:efficientnet_lite0")


@register_task
class CausalLM(Task):
    name = "causal-lm"
    classifier = False  # its evaluation is its loss (perplexity from it): no logits gathered
    methods = ("lora", "full", "qlora")
    packs = True
    rows_word = "rows"

    def check_config(self, cfg) -> None:

        def bad(key: str, fix: str) -> ConfigError:
            return ConfigError(f"{key}={getattr(cfg, key)!r}: {fix}")

        if cfg.model in CLASSIFIER_BUILTINS:
            raise bad("model", "task=causal-lm needs a causal language model: model=builtin:smollm2, a local directory or a hub id")
        if cfg.lora_r < 1:
            raise bad("lora_r", "must be at least 1 (16 is a good start)")
        if cfg.lora_alpha <= 0:
            raise bad("lora_alpha", "must be positive (commonly 2 x lora_r)")
        if not 0 <= cfg.lora_dropout < 1:
            raise bad("lora_dropout", "must be in [0, 1)")
        if not cfg.lora_target_modules.strip():
            raise bad("lora_target_modules", "use all-linear or comma-separated module names such as q_proj,v_proj")
        if cfg.merge_adapter and cfg.method == "full":
            raise bad("merge_adapter", "method=full trains the model itself, there is no adapter to merge: drop merge_adapter")
        if cfg.packing not in (True, False, "auto"):
            raise bad("packing", "use auto, true or false")
        if cfg.chunked_lm_loss not in (True, False, "auto", "liger", "cce"):
            raise bad("chunked_lm_loss", "use auto, true or false (or, on CUDA, liger or cce: their fused kernels)")
        if cfg.generation_samples < 0:
            raise bad("generation_samples", "must be >= 0 (0: no samples)")
        if cfg.generation_max_new_tokens < 1:
            raise bad("generation_max_new_tokens", "must be at least 1")
        if cfg.chat_template is not None and not Path(cfg.chat_template).expanduser().is_file():
            raise bad("chat_template", "give the path of a Jinja chat template file that exists")

    def default_learning_rate(self, cfg) -> float | None:
        return ADAPTER_LEARNING_RATE if cfg.method in ("lora", "qlora") else CAUSAL_LM_FULL_LEARNING_RATE

    def prepare(self, cfg, runtime, say) -> Prepared:
        from ..causal_lm.prepare import (
            prepare_causal_lm,  # lazy: the config reads this registry, and the finetune modules import the config
        )

        lm = prepare_causal_lm(cfg, runtime, say)
        return Prepared(lm.model, lm.train, lm.validation, lm.collator, lm.tokenizer, lm.data)

    def confirm_model(self, model, cfg, precision: str) -> str | None:
        from ..causal_lm.prepare import (
            confirm_chunked_head,  # lazy: the config reads this registry, and the finetune modules import the config
        )

        return confirm_chunked_head(model, cfg, precision)

    def before_training(self, trainer, cfg, prepared: Prepared):
        from ..causal_lm.generation import (
            GenerationSamples,  # lazy: the config reads this registry, and the finetune modules import the config
        )

        samples = GenerationSamples(cfg, prepared.data.generation_prompts, prepared.processing_class)
        samples.generate_before(trainer)
        return samples

    def final_metrics(self, metrics: dict) -> dict:
        from ..causal_lm.outputs import (
            with_perplexity,  # lazy: the config reads this registry, and the finetune modules import the config
        )

        return with_perplexity(metrics)

    def after_training(self, trainer, cfg, prepared: Prepared, runtime, started, saving) -> None:
        from ..causal_lm.model import (
            compute_dtype,  # lazy: the config reads this registry, and the finetune modules import the config
        )
        from ..causal_lm.outputs import (
            merge_and_save,  # lazy: the config reads this registry, and the finetune modules import the config
        )

        started.generate_after(trainer)  # generations.json, and a section of report.md
        with saving():
            merge_and_save(cfg, trainer, prepared.processing_class, prepared.data.model_path, compute_dtype(runtime))

    def planner_model(self, cfg) -> str:
        from ..causal_lm.model import (
            model_path,  # lazy: the config reads this registry, and the finetune modules import the config
        )

        return model_path(cfg)
