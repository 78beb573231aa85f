"""DeepSpeed as the launcher asked for it, known before the Trainer exists.

``accelerate launch`` with a DeepSpeed config exports it to every process (``ACCELERATE_USE_DEEPSPEED``, the ZeRO stage
or the config file's path), and transformers learns of it only when ``TrainingArguments`` are built: its
``is_deepspeed_zero3_enabled()`` reads a global those arguments set. ``scripts/finetune.py`` loads the model before
that, so two things would go wrong under ZeRO-3:

- the model would load whole on every process (no ``deepspeed.zero.Init``): 8 processes of an 8B model in fp32 hold
  256 GB of host memory before DeepSpeed partitions anything;
- the chunked LM head (``tasks/language_modeling/lm_head_loss.py``) would be installed, and it reads the head's weight outside the
  head's own forward, where ZeRO-3 keeps it partitioned.

``hold_zero3_init`` does before loading what accelerate does for a script without a Trainer
(``DeepSpeedPlugin.set_deepspeed_weakref``): transformers then loads under ``zero.Init``, and every check sees ZeRO-3.
"""

from __future__ import annotations

import json
import os

from .config import ConfigError


def deepspeed_requested(environ=None) -> bool:
    environ = os.environ if environ is None else environ
    return str(environ.get("ACCELERATE_USE_DEEPSPEED", "false")).lower() == "true"


def zero_stage_requested(environ=None) -> int | None:
    """The ZeRO stage the launch asked for (its config file's, else the YAML's ``zero_stage``, else accelerate's default
    2), or None without DeepSpeed."""
    environ = os.environ if environ is None else environ
    if not deepspeed_requested(environ):
        return None
    zero = (_config_file(environ) or {}).get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, dict) else None
    if isinstance(stage, int):
        return stage
    stage = str(environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))
    return int(stage) if stage.isdigit() else 2


def _config_file(environ) -> dict | None:
    path = environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if not path or path == "none":
        return None
    try:
        data = json.loads(open(path).read())
    except (OSError, ValueError):
        return None  # accelerate names an unreadable file itself when it builds the plugin
    return data if isinstance(data, dict) else None


def deepspeed_optimizer_line(extra: dict, weight_decay: float, environ=None) -> str | None:
    """A DeepSpeed config file with an ``optimizer`` section (a ZeRO-Offload plan's NAME.deepspeed.json) steps the
    parameters with DeepSpeed's optimizer, not the Trainer's: ``optim`` would be ignored (refused, named), and every
    trainable parameter is one group, so weight decay reaches norms and biases too, which the Trainer's AdamW leaves
    out (said, once). None without such a file."""

    environ = os.environ if environ is None else environ
    if not deepspeed_requested(environ):
        return None
    optimizer = (_config_file(environ) or {}).get("optimizer")
    if not isinstance(optimizer, dict):
        return None
    path = environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"]
    if "optim" in extra:
        raise ConfigError(f"extra={{optim: {extra['optim']}}}: the DeepSpeed config {path} names its own optimizer "
                          f"({optimizer.get('type')}), which steps the parameters instead; drop optim, or the file's optimizer "
                          "section (DeepSpeed then refuses optimizer offloading with the Trainer's)")
    return (f"optimizer: DeepSpeed's {optimizer.get('type')} from {path} (one parameter group: weight_decay={weight_decay} "
            "reaches norms and biases too, which the Trainer's AdamW leaves out)")


def zero3_requested(environ=None) -> bool:
    return zero_stage_requested(environ) == 3


def hold_zero3_init(precision: str = "fp32", environ=None):
    """Under a ZeRO-3 launch: the DeepSpeed plugin whose config transformers now sees (keep it alive until the Trainer's
    arguments exist; they set their own), so ``from_pretrained`` partitions the model as it loads, in the run's
    ``precision`` (bf16/fp16/fp32: accelerate fills the config's ``"auto"`` precision before its own weakref, and
    ``zero.Init`` would otherwise partition fp32 weights that DeepSpeed never casts again). None otherwise, or when the
    launch config turned ``zero3_init_flag`` off."""
    environ = os.environ if environ is None else environ
    if not zero3_requested(environ):
        return None
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin()
    if not plugin.zero3_init_flag:
        return None
    plugin.set_mixed_precision({"bf16": "bf16", "fp16": "fp16"}.get(precision, "no"))
    plugin.set_deepspeed_weakref()
    return plugin
