"""``hf-gpu-train check-config FILE.yaml``: lint an accelerate config against a machine."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from ..errors import UsageError
from ..launch.render import env_path_for, parse_env
from ..plan.lint import ERROR, Finding, lint, plan_findings
from ..plan.run_plan_file import plan_path_for
from .common import add_machine_argument, resolve_profile


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("check-config", help="check an accelerate config against this machine (or a snapshot)",
                              description="Errors exit 1, a clean config exits 0, an unreadable file exits 2.")
    p.add_argument("config_file")
    add_machine_argument(p)
    return p


def run(args: argparse.Namespace) -> int:

    path = Path(args.config_file)
    try:
        config = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise UsageError(f"cannot read {path} as YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(config, dict):
        raise UsageError(f"{path} is not an accelerate config (expected a mapping of keys)")
    env_file = env_path_for(path)
    env = parse_env(env_file.read_text()) if env_file.is_file() else {}
    profile, _ = resolve_profile(args)
    findings = lint(config, profile, env)
    findings += [Finding(level, message) for level, message in plan_findings(plan_path_for(path), profile)]
    for f in findings:
        print(f"{f.level}: {f.message}")
    errors = sum(f.level == ERROR for f in findings)
    print(f"{path}: {errors} error(s), {len(findings) - errors} warning(s) against {profile.display_name}")
    return 1 if errors else 0
