"""``hf-gpu-train launch``: accelerate launch with the plan's environment (NAME.env) applied."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from ..errors import UsageError


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("launch", help="accelerate launch with the config's .env applied",
                              description="Run `accelerate launch --config_file FILE SCRIPT ARGS` with the variables of "
                              "FILE's .env (written by `hf-gpu-train config`) in the environment of every process.")
    p.add_argument("--config-file", required=True, help="accelerate YAML written by `hf-gpu-train config`")
    p.add_argument("script", help="training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def build_command(config_file: Path, script: str, script_args: list[str]) -> tuple[list[str], dict[str, str]]:
    from ..launch.render import env_path_for, parse_env

    if not config_file.is_file():
        raise UsageError(f"--config-file {config_file} does not exist: write one with `hf-gpu-train config --output ...`")
    env = dict(os.environ)
    env_file = env_path_for(config_file)
    if env_file.is_file():
        env.update(parse_env(env_file.read_text()))
    # The accelerate of this interpreter, whatever PATH says.
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(config_file), script, *script_args]
    return cmd, env


def run(args: argparse.Namespace) -> int:
    if not Path(args.script).exists():
        raise UsageError(f"training script {args.script} does not exist")
    cmd, env = build_command(Path(args.config_file), args.script, args.script_args)
    return subprocess.call(cmd, env=env)
