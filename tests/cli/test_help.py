"""Issue 20: `hf-gpu-train --help` lists each subcommand with one line, and each subcommand's --help ends with a
runnable example, which parses as the documentation's commands do (tests/test_docs.py)."""

from __future__ import annotations

import contextlib
import io

import pytest

from hf_gpu_train.cli import EXAMPLES, SUBCOMMANDS, main
from tests.test_docs import Command, command_problems, split_command


def help_text(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) if argv[-1:] == ("--help",) and argv[:1] not in (
            ("launch",), ("tune",)) else contextlib.nullcontext():
        main(list(argv))
    return out.getvalue()


@pytest.mark.parametrize("columns", ["80", "100"])
def test_the_command_list_has_one_line_per_subcommand(monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", columns)  # a narrow terminal: the list is drawn 100 wide at the least
    lines = help_text("--help").splitlines()
    for name in SUBCOMMANDS:
        at = next(i for i, line in enumerate(lines) if line.strip().startswith(name + " ") or line.strip() == name)
        line, following = lines[at], lines[at + 1]
        assert line.strip() != name and len(line.split(None, 1)) == 2, f"{name}: its help is not on its line: {line!r}"
        continued = following.startswith(" " * 8) and not any(following.strip().startswith(n + " ") for n in SUBCOMMANDS)
        assert not continued, f"{name}: its help runs onto a second line: {following!r}"


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_subcommand_help_ends_with_an_example_that_parses(name):
    text = help_text(name, "--help").rstrip()
    assert text.endswith(EXAMPLES[name]) and "example:" in text.splitlines()[-2]
    assert EXAMPLES[name].startswith(f"hf-gpu-train {name}")
    example = Command(page="hf-gpu-train --help", where=name, text=EXAMPLES[name], words=split_command(EXAMPLES[name]), inline=False)
    assert command_problems(example) == []
