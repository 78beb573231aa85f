"""Split an `accelerate launch` command line into its own options, the script, and the script's arguments.

Two readers need the split without importing accelerate (which imports torch): ``hf-gpu-train launch``,
which passes accelerate's options through, and a training process reading its launcher's command line in
/proc to find ``--config_file``. Everything before the script that starts with ``-`` is a launch option; an
option takes one value unless it is one of accelerate's switches below (``tests/launch`` compares this set
with accelerate's own parser, so a new accelerate switch fails a test instead of eating the script's name).
The script's own arguments are never read as launch options (``finetune.py --config recipe.yaml`` is the
script's ``--config``, not accelerate's).
"""

from __future__ import annotations

from dataclasses import dataclass

# accelerate 1.15 `accelerate launch` options that take no value (argparse nargs=0), both spellings.
SWITCHES = frozenset({
    "-h", "--help", "-q", "--quiet", "--cpu", "--multi_gpu", "--multi-gpu", "--tpu", "--enable_cpu_affinity",
    "--enable-cpu-affinity", "--dynamo_use_fullgraph", "--dynamo-use-fullgraph", "--dynamo_use_dynamic",
    "--dynamo-use-dynamic", "--dynamo_use_regional_compilation", "--dynamo-use-regional-compilation", "--use_deepspeed",
    "--use-deepspeed", "--use_fsdp", "--use-fsdp", "--use_parallelism_config", "--use-parallelism-config",
    "--use_megatron_lm", "--use-megatron-lm", "--same_network", "--same-network", "-m", "--module", "--no_python",
    "--no-python", "--tpu_cluster", "--tpu-cluster", "--no_tpu_cluster", "--no-tpu-cluster", "--tpu_use_sudo",
    "--tpu-use-sudo", "--downcast_bf16", "--downcast-bf16", "--fp8_use_autocast_during_eval",
    "--fp8-use-autocast-during-eval", "--debug",
})
CONFIG_FILE_OPTIONS = ("--config_file", "--config-file")


@dataclass(frozen=True)
class LaunchArgv:
    """``options`` as (name, value) pairs in order (value None for a switch); ``script`` None when absent."""

    options: tuple[tuple[str, str | None], ...]
    script: str | None
    script_args: tuple[str, ...]

    def value(self, *names: str) -> str | None:
        """The last value given for any of these spellings (argparse keeps the last)."""
        found = None
        for name, value in self.options:
            if name in names:
                found = value
        return found

    def has(self, *names: str) -> bool:
        return any(name in names for name, _ in self.options)

    def without(self, *names: str) -> tuple[tuple[str, str | None], ...]:
        return tuple((n, v) for n, v in self.options if n not in names)

    def argv_without(self, *names: str) -> list[str]:
        """The command line again, less these options (every spelling given): what a launcher that takes its own
        options out of accelerate's passes on."""
        return [*flatten(self.without(*names)), *([] if self.script is None else [self.script]), *self.script_args]

    def settings(self) -> dict[str, str | bool]:
        """Options by accelerate's key (``--num-processes 2`` -> {"num_processes": "2"}; a switch -> True)."""
        return {name.lstrip("-").replace("-", "_"): True if value is None else value for name, value in self.options}


def split_launch_argv(argv: list[str] | tuple[str, ...]) -> LaunchArgv:
    """Options up to the first token that is not an option or an option's value; that token is the script."""
    options: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            i += 1
            break
        if not token.startswith("-") or token == "-":
            break
        name, eq, value = token.partition("=")
        if eq and name.startswith("--"):
            options.append((name, value))
        elif token in SWITCHES:
            options.append((token, None))
        else:
            options.append((token, argv[i + 1] if i + 1 < len(argv) else None))
            i += 1
        i += 1
    script = argv[i] if i < len(argv) else None
    return LaunchArgv(tuple(options), script, tuple(argv[i + 1:]))


def flatten(options: tuple[tuple[str, str | None], ...]) -> list[str]:
    """(name, value) pairs back to command-line tokens."""
    tokens: list[str] = []
    for name, value in options:
        tokens += [name] if value is None else [name, value]
    return tokens


def accelerate_launch_args(cmdline: list[str]) -> list[str] | None:
    """The arguments after `launch` when ``cmdline`` (a process's argv) runs `accelerate launch`, else None.

    Recognised: ``accelerate launch``, ``python .../bin/accelerate launch`` (a console script's argv in /proc),
    ``python -m accelerate.commands.accelerate_cli launch`` and ``python -m accelerate.commands.launch`` (what
    ``hf-gpu-train launch`` runs). A script that merely has "accelerate" among its arguments is not."""
    if not cmdline:
        return None
    rest = list(cmdline)
    if rest[0].rsplit("/", 1)[-1].startswith("python"):
        rest = rest[1:]
        while rest and rest[0].startswith("-") and rest[0] != "-m":  # interpreter flags (-u, -B, ...)
            rest = rest[1:]
        if rest[:2] == ["-m", "accelerate.commands.launch"]:
            return rest[2:]
        if rest[:2] == ["-m", "accelerate.commands.accelerate_cli"]:
            rest = ["accelerate", *rest[2:]]
    if rest and rest[0].rsplit("/", 1)[-1] == "accelerate" and rest[1:2] == ["launch"]:
        return rest[2:]
    return None
