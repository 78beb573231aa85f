"""Errors the user can fix. The CLI prints their message (no traceback) and exits 2."""
import os
import sys


class UsageError(Exception):
    """Bad input from the user: the message names the bad value and the fix."""


# `hf-gpu-train launch` names a file here; a training process that stops on a usage error writes its one line to it,
# so the launcher can end with that line and exit 2 instead of torchrun's report of a failed worker.
USAGE_ERROR_FILE_ENV = "HF_GPU_TRAIN_USAGE_ERROR_FILE"


def report_usage_error(message: str, environ=None) -> None:
    """Print the one line a user needs, and leave it for `hf-gpu-train launch` when it started this process."""

    environ = os.environ if environ is None else environ
    print(message, file=sys.stderr, flush=True)
    target = environ.get(USAGE_ERROR_FILE_ENV)
    if target:
        with open(target, "a") as f:
            f.write(message + "\n")


class PlanError(UsageError):
    """The hardware cannot honour what was asked: the message names the GPU and the alternative."""


class ConfigError(UsageError):
    """A bad finetune config value: names the key, the value and the fix."""
