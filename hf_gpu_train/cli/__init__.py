"""``hf-gpu-train``: one module per subcommand, each with ``register(subparsers)`` and ``run(args) -> int``.

Subcommand modules import only what they need at call time: ``detect`` must not import torch.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys

from .. import __version__
from ..closed_pipe import until_the_pipe_closes
from ..errors import UsageError
from ..fast_exit import end_quickly

SUBCOMMANDS = ("detect", "doctor", "machines", "config", "finetune", "launch", "check-config", "plan-memory", "report", "tune")
# One runnable example per subcommand, printed at the end of its --help (tests/cli/test_help.py parses each).
EXAMPLES = {
    "detect": "hf-gpu-train detect --save box.json",
    "doctor": "hf-gpu-train doctor",
    "machines": "hf-gpu-train machines",
    "config": "hf-gpu-train config --machine 1x-h200 --model builtin:minilm --output launch_configs/h200",
    "finetune": "hf-gpu-train finetune --config minilm_text_demo max_steps=20",
    "launch": "hf-gpu-train launch --config-file launch_configs/cpu-only.yaml -m hf_gpu_train.finetune --config minilm_text_demo",
    "check-config": "hf-gpu-train check-config launch_configs/2x-rtx4090.yaml --machine 2x-rtx4090",
    "plan-memory": "hf-gpu-train plan-memory --machine 1x-h200 --params 8e9 --seq-len 4096",
    "report": "hf-gpu-train report outputs/minilm_text_demo",
    "tune": "hf-gpu-train tune --config-file launch_configs/cpu-only.yaml -m hf_gpu_train.finetune --config minilm_text_demo",
}


def example(name: str) -> str:
    """The lines that end ``hf-gpu-train NAME --help``."""
    return f"example:\n  {EXAMPLES[name]}"


class _OneLineCommands(argparse.RawDescriptionHelpFormatter):
    """Each subcommand and its help on one line (argparse would push a long name's help to the next)."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=24, width=max(100, min(140, _columns())))

    def add_argument(self, action):
        super().add_argument(action)
        if isinstance(action, argparse._SubParsersAction):  # its commands are indented one step more than it measures
            self._action_max_length += self._indent_increment


def _columns() -> int:

    return shutil.get_terminal_size((100, 24)).columns


def build_parser() -> argparse.ArgumentParser:

    parser = argparse.ArgumentParser(
        prog="hf-gpu-train",
        description="Detect GPUs, check the stack, plan and run fine-tuning for Hugging Face Trainer/Accelerate.",
        formatter_class=_OneLineCommands,
        epilog="Each command's --help ends with an example; the documentation: docs/README.md of the source repository",
    )
    parser.add_argument("--version", action="version", version=f"hf-gpu-train {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in SUBCOMMANDS:
        module = importlib.import_module(f".{name.replace('-', '_')}", __name__)
        sub = module.register(subparsers)
        sub.set_defaults(handler=module.run)
        sub.formatter_class = argparse.RawDescriptionHelpFormatter
        sub.epilog = "\n\n".join(part for part in (sub.epilog, example(name)) if part)
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

    end_quickly()
    sys.exit(main())
