"""``hf-gpu-train``: one module per subcommand, each with ``register(subparsers)`` and ``run(args) -> int``.

Subcommand modules import only what they need at call time: ``detect`` must not import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ..closed_pipe import EXIT_CLOSED_PIPE, until_the_pipe_closes  # noqa: F401 (EXIT_CLOSED_PIPE: the status, see closed_pipe)
from ..errors import UsageError

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


def main(argv: list[str] | None = None) -> int:
    return until_the_pipe_closes(lambda: _run(argv))


def entry_point() -> None:
    from ..fast_exit import end_quickly

    end_quickly()
    sys.exit(main())
