"""Splitting `accelerate launch` command lines: options, script, the script's own arguments."""

import pytest

from hf_gpu_train.plan.accelerate_argv import SWITCHES, accelerate_launch_args, flatten, split_launch_argv


def test_switches_are_exactly_accelerates_value_less_options():
    from accelerate.commands.launch import launch_command_parser

    theirs = {name for action in launch_command_parser()._actions if action.option_strings and action.nargs == 0
              for name in action.option_strings}
    assert SWITCHES == theirs  # a new accelerate switch would otherwise swallow the script's name as its value


def test_options_values_switches_and_the_scripts_own_arguments():
    argv = ["--num_processes", "2", "--same_network", "--config-file=box.yaml", "--gpu-ids", "0,1", "-m", "pkg.train",
            "--config", "recipe.yaml", "--num_processes", "9"]
    split = split_launch_argv(argv)
    assert split.options == (("--num_processes", "2"), ("--same_network", None), ("--config-file", "box.yaml"),
                             ("--gpu-ids", "0,1"), ("-m", None))
    assert split.script == "pkg.train" and split.script_args == ("--config", "recipe.yaml", "--num_processes", "9")
    assert split.value("--config_file", "--config-file") == "box.yaml"
    assert split.settings() == {"num_processes": "2", "same_network": True, "config_file": "box.yaml", "gpu_ids": "0,1",
                                "m": True}
    assert flatten(split.without("--config-file")) == ["--num_processes", "2", "--same_network", "--gpu-ids", "0,1", "-m"]


def test_last_value_wins_and_a_missing_script_is_none():
    split = split_launch_argv(["--main_process_port", "1", "--main_process_port=2"])
    assert split.value("--main_process_port") == "2" and split.script is None and split.script_args == ()
    assert split_launch_argv(["--", "train.py", "-x"]).script == "train.py"


@pytest.mark.parametrize("cmdline, expected", [
    (["/venv/bin/python3", "/venv/bin/accelerate", "launch", "--config_file", "a.yaml", "t.py"], ["--config_file", "a.yaml", "t.py"]),
    (["accelerate", "launch", "t.py"], ["t.py"]),
    (["/usr/bin/python", "-m", "accelerate.commands.accelerate_cli", "launch", "--cpu", "t.py"], ["--cpu", "t.py"]),
    (["python", "-m", "accelerate.commands.launch", "--config_file", "b.yaml", "t.py"], ["--config_file", "b.yaml", "t.py"]),
    (["/venv/bin/accelerate", "env"], None),
    (["python", "-m", "torch.distributed.run", "--nproc-per-node=2", "t.py"], None),
    (["python", "train.py", "accelerate", "launch"], None),
])
def test_which_command_lines_are_accelerate_launch(cmdline, expected):
    assert accelerate_launch_args(cmdline) == expected
