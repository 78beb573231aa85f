"""``task=causal-lm``: supervised fine-tuning of a causal language model (LoRA, QLoRA or full), on text or chat
rows, packed where the model's attention keeps examples apart, evaluated by its loss (perplexity), with generation
samples before and after training and the adapter merged at the end. The machinery is this folder's other modules."""

from __future__ import annotations

from ....errors import ConfigError
from ....plan.evaluation_memory import evaluation_memory
from ..base import PlannerInput, Prepared, Task, register_task
from . import smollm2
from .generation import GenerationSamples
from .model import compute_dtype, model_path
from .options import CausalLMOptions
from .outputs import merge_and_save, with_perplexity

# Full fine-tuning: 2e-5, TRL SFTConfig's default (a pretrained LM moves less than an encoder with a fresh head).
# LoRA/QLoRA: 2e-4, the QLoRA paper's rate for 7B-13B models (Dettmers et al. 2023, table 9); the adapters start at
# zero and have few parameters, so they take larger steps.
CAUSAL_LM_FULL_LEARNING_RATE = 2e-5
ADAPTER_LEARNING_RATE = 2e-4
CLASSIFIER_BUILTINS = ("builtin:minilm", "builtin:efficientnet_lite0")


@register_task
class CausalLM(Task):
    name = "causal-lm"
    options = CausalLMOptions
    classifier = False  # its evaluation is its loss (perplexity from it): no logits gathered
    methods = ("lora", "full", "qlora")
    packs = True
    rows_word = "rows"

    def check_config(self, cfg) -> None:
        if cfg.model in CLASSIFIER_BUILTINS:
            raise ConfigError(f"model={cfg.model!r}: task=causal-lm needs a causal language model: model=builtin:smollm2, a local "
                              "directory or a hub id")
        if cfg.merge_adapter and cfg.method == "full":
            raise ConfigError(f"merge_adapter={cfg.merge_adapter!r}: method=full trains the model itself, there is no adapter "
                              "to merge: drop merge_adapter")

    def attention(self, cfg) -> str | None:
        return cfg.attn_implementation

    def default_learning_rate(self, cfg) -> float | None:
        return ADAPTER_LEARNING_RATE if cfg.method in ("lora", "qlora") else CAUSAL_LM_FULL_LEARNING_RATE

    def planner_input(self, cfg) -> PlannerInput:
        return PlannerInput(seq_len=cfg.max_length, image_size=None, method=cfg.method, lora_rank=cfg.lora_r)

    def evaluation_line(self, model, cfg, rows: int, classes: int) -> str:
        """Its evaluation is the loss (perplexity): the logits of rows x max_length x vocabulary are never kept."""
        vocabulary = getattr(getattr(model, "config", None), "vocab_size", None) or 1
        return evaluation_memory(rows, cfg.max_length, vocabulary, True, "the loss only").reason()

    def prepare(self, cfg, runtime, say) -> Prepared:
        from .prepare import prepare_causal_lm  # lazy: torch (collate, the chunked head)

        lm = prepare_causal_lm(cfg, runtime, say)
        return Prepared(lm.model, lm.train, lm.validation, lm.collator, lm.tokenizer, lm.data)

    def confirm_model(self, model, cfg, precision: str) -> str | None:
        from .prepare import confirm_chunked_head  # lazy: torch (the chunked head)

        return confirm_chunked_head(model, cfg.options, precision)

    def before_training(self, trainer, cfg, prepared: Prepared):
        samples = GenerationSamples(cfg.options, cfg.output_dir, prepared.data.generation_prompts, prepared.processing_class)
        samples.generate_before(trainer)
        return samples

    def final_metrics(self, metrics: dict) -> dict:
        return with_perplexity(metrics)

    def after_training(self, trainer, cfg, prepared: Prepared, runtime, started, saving) -> None:
        started.generate_after(trainer)  # generations.json, and a section of report.md
        with saving():
            merge_and_save(cfg.merge_adapter, cfg.method, cfg.output_dir, trainer, prepared.processing_class,
                           prepared.data.model_path, compute_dtype(runtime))

    def planner_model_here(self, cfg) -> tuple[str | None, str | None]:
        if cfg.model == smollm2.BUILTIN_NAME:  # converted on first use: read where it was, never converted here
            return (str(smollm2.converted_dir()), None) if smollm2.is_converted() else (None, "builtin:smollm2 is not converted yet")
        return cfg.model, None

    def planner_model(self, cfg) -> str:
        return model_path(cfg.model)
