"""Arguments and helpers shared by subcommands."""

from __future__ import annotations

import argparse
import json
import sys

from ..hardware.detect import detect
from ..hardware.profile import HardwareProfile
from ..hardware.snapshot import load_machine


def add_machine_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--machine",
        metavar="FILE_OR_NAME",
        help="use a saved snapshot (detect --save) or a reference machine (see `hf-gpu-train machines`) "
        "instead of this machine",
    )


def resolve_profile(args: argparse.Namespace) -> tuple[HardwareProfile, bool]:
    """(profile, live): the snapshot named by --machine, or this machine detected now."""
    if getattr(args, "machine", None):

        return load_machine(args.machine), False

    return detect(), True


def print_json(data: object) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")
