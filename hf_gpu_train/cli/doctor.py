"""``hf-gpu-train doctor``: is this box ready to train? Each check with its exact fix."""

from __future__ import annotations

import argparse

from ..doctor import exit_code, run_checks
from ..doctor.live_checks import RealTorchProbe
from ..hardware.software import detect_software
from .common import add_machine_argument, print_json, resolve_profile

SYMBOL = {"PASS": "PASS", "WARN": "WARN", "FAIL": "FAIL", "SKIP": "skip"}


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("doctor", help="preflight checks of driver, GPUs, torch stack and a small training step",
                              description="Preflight checks in the order a careful engineer runs them. "
                              "Exit 0 when nothing failed, 1 when something did.")
    add_machine_argument(p)
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.add_argument("--output-dir", default=".", help="where the run will write (free disk is checked there)")
    return p


def run(args: argparse.Namespace) -> int:

    profile, live = resolve_profile(args)
    software = profile.software
    probe = None
    if live:

        software = detect_software()
        probe = RealTorchProbe()
    checks = run_checks(profile, software, probe, live=live, output_dir=args.output_dir)
    code = exit_code(checks)
    if args.json:
        print_json({"machine": profile.display_name, "live": live, "exit_code": code,
                    "checks": [c.to_dict() for c in checks]})
        return code
    print(f"hf-gpu-train doctor: {profile.display_name} ({'this machine' if live else 'snapshot'})")
    for c in checks:
        print(f"[{SYMBOL[c.status]}] {c.name}: {c.detail}")
        if c.fix and c.status in ("FAIL", "WARN"):
            print(f"       fix: {c.fix}")
    failed = sum(c.status == "FAIL" for c in checks)
    warned = sum(c.status == "WARN" for c in checks)
    print(f"\n{failed} failed, {warned} warning(s): " + ("not ready, fix the FAIL lines first" if failed else "ready"))
    return code
