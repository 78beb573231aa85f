"""``hf-gpu-train machines``: the reference machines shipped with the package."""

from __future__ import annotations

import argparse

from ..hardware.snapshot import load_machine, reference_machine_names
from ..textfmt import table


def register(subparsers) -> argparse.ArgumentParser:
    return subparsers.add_parser("machines", help="list the shipped reference machines (for --machine NAME)",
                                 description="List the reference machine snapshots shipped with hf_gpu_train.")


def run(args: argparse.Namespace) -> int:

    rows = [["Name", "GPUs", "Description"]]
    for name in reference_machine_names():
        m = load_machine(name)
        gpus = f"{len(m.gpus)}x {m.gpus[0].name}" if m.gpus and len({g.name for g in m.gpus}) == 1 else (
            " + ".join(g.name for g in m.gpus) or "none")
        rows.append([name, gpus, m.description or ""])
    print(table(rows))
    print("\nUse one with --machine NAME, e.g. `hf-gpu-train config --machine 8x-h100-sxm ...`.")
    return 0
