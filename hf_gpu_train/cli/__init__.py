"""``hf-gpu-train``: one module per subcommand, each with ``register(subparsers)`` and ``run(args) -> int``.

Subcommand modules import only what they need at call time: ``detect`` must not import torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ..errors import UsageError

# A reader that stops early (`hf-gpu-train machines | head -1`) closes the pipe. C tools die of SIGPIPE there,
# which a shell reports as 128 + 13 = 141; we exit with the same status, quietly, so `set -o pipefail` scripts see
# what they see for `cat | head`, and nobody is told that a complete write happened when it did not.
EXIT_CLOSED_PIPE = 141

SUBCOMMANDS = ("detect", "doctor", "machines", "config", "launch", "check-config", "plan-memory", "report", "tune")


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="hf-gpu-train",
        description="Detect GPUs, check the stack, and plan fine-tuning runs for Hugging Face Trainer/Accelerate.",
    )
    parser.add_argument("--version", action="version", version=f"hf-gpu-train {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in SUBCOMMANDS:
        module = importlib.import_module(f".{name.replace('-', '_')}", __name__)
        sub = module.register(subparsers)
        sub.set_defaults(handler=module.run)
    return parser


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except UsageError as error:
        print(f"hf-gpu-train {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _stdout_to_devnull() -> None:
    """Point fd 1 at /dev/null, so the interpreter's last flush at exit cannot fail again (Python docs, signal module,
    "Note on SIGPIPE"). Under pytest's capture stdout has no file descriptor, and there is nothing to redirect."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()  # a closed pipe surfaces here, inside the try, not as a traceback at interpreter exit
    except BrokenPipeError:
        _stdout_to_devnull()
        return EXIT_CLOSED_PIPE


def entry_point() -> None:
    sys.exit(main())
