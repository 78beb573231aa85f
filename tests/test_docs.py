"""The documentation holds together: README.md and every docs/*.md page.

- every relative markdown link points at a file or folder that exists (and, into a markdown page, at a heading
  that exists when it names an ``#anchor``);
- every repository path a page names in backticks exists;
- every ``hf-gpu-train ...`` command a page shows parses with the real CLI parser, its subcommand's ``--help`` exits
  0, and the files it names (scripts, recipes, launch configs, machine snapshots) exist; ``python``, ``pytest``,
  ``bash``, ``sbatch`` and ``accelerate launch`` commands name scripts and files that exist.

Fast and in-process: the CLI parser is the package's own (``hf_gpu_train.cli.build_parser``), nothing is launched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

# Inline code that starts with one of these names a file or folder of the repository.
REPO_PREFIXES = ("hf_gpu_train/", "scripts/", "benchmarks/", "recipes/", "tests/", "launch_configs/", "examples/", "docs/")

# A word in backticks with one of these is a pattern, not a path (the definition of a path-like token; no page
# holds one today, so nothing is skipped by it).
PATTERN_CHARS = ("*", "<", "{", "=", "...")

# Files named in the pages that stand for the reader's own files, each with its reason; everything else a page names
# (a path in backticks, a command's script, --config-file / --config_file / --config recipe, --machine snapshot) must
# exist. test_every_placeholder_is_used keeps this list exact.
PLACEHOLDERS = {
    "launch_configs/box.yaml": "written by `hf-gpu-train config --output launch_configs/box` on your own machine",
    "launch_configs/t4.yaml": "the config a user would write for a T4 box (tune's dry-run example)",
    "box.yaml": "the config written by `hf-gpu-train config --output box` (launch's override example)",
    "NAME.yaml": "usage syntax: the config `hf-gpu-train config --output DIR/NAME` writes",
    "recipes/x.yaml": "any recipe (the launch and tune examples)",
    "box.json": "a snapshot written by `hf-gpu-train detect --save box.json` on your own machine",
    "SCRIPT": "usage syntax for the training script (`hf-gpu-train launch [ACCELERATE_OPTIONS] ... SCRIPT ARGS`)",
    "...": "an elided training script and its arguments (`hf-gpu-train launch --config-file ... ...`)",
}
USED: set[str] = set()


def placeholder(value: str) -> bool:
    if value in PLACEHOLDERS:
        USED.add(value)
        return True
    return False


# Commands shown on purpose in a form that does not parse, each with its reason: (page, command) -> reason.
NOT_PARSED: dict[tuple[str, str], str] = {}

FENCE = re.compile(r"^\s*(```+|~~~+)\s*(\S*)")
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.S)  # within a paragraph
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^()\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
USAGE_GROUP = re.compile(r"\[[^\]]*\]")  # [ACCELERATE_OPTIONS], [--machine ...]: optional parts of a usage line
STOPS = ("|", "||", "&", "&&", ";", ">", ">>", "<")
# How a command line starts, in a fenced block without `$ ` prompts (other lines there are output).
COMMAND_START = re.compile(r"^(hf-gpu-train|python3?|pytest|bash|sbatch|accelerate|torchrun|pip|\.venv/bin/\S+|[A-Z_][A-Z0-9_]*=\S*)(\s|$)")


@dataclasses.dataclass(frozen=True)
class Page:
    path: Path
    prose: str  # the text with fenced blocks blanked out (line numbers kept)
    blocks: tuple[tuple[int, str, tuple[str, ...]], ...]  # (first line, info string, lines)

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT))


@functools.cache
def page(path: Path) -> Page:
    prose: list[str] = []
    blocks: list[tuple[int, str, tuple[str, ...]]] = []
    fence = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = FENCE.match(line)
        if fence is None and match:
            fence, info, start, body = match.group(1), match.group(2), number, []
            prose.append("")
        elif fence is not None:
            if match and match.group(1).startswith(fence[0]) and len(match.group(1)) >= len(fence) and not match.group(2):
                blocks.append((start, info, tuple(body)))
                fence = None
            else:
                body.append(line)
            prose.append("")
        else:
            prose.append(line)
    assert fence is None, f"{path}: a fenced block opened at line {start} is never closed"
    return Page(path, "\n".join(prose), tuple(blocks))


def code_spans(text: str) -> list[str]:
    """Inline code spans, a span broken over lines joined with a space (as markdown renders it)."""
    return [" ".join(m.group(2).split()) for m in CODE_SPAN.finditer(text)]


def without_code_spans(text: str) -> str:
    return CODE_SPAN.sub(lambda m: " " * len(m.group(0)), text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in page(path).prose.splitlines():
        match = re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def page_ids() -> list[str]:
    return [str(p.relative_to(ROOT)) for p in PAGES]


# ---------------------------------------------------------------------------------------------------------------- links

def links(p: Page) -> list[str]:
    text = without_code_spans(p.prose)
    return [m.group(1) for m in LINK.finditer(text)] + [m.group(1) for m in REFERENCE_LINK.finditer(text)]


def link_problem(p: Page, target: str) -> str | None:
    if re.match(r"^(https?:|mailto:)", target):
        return None
    path_part, _, anchor = target.partition("#")
    resolved = (p.path.parent / path_part).resolve() if path_part else p.path
    if not resolved.exists():
        return f"{target}: {resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved} does not exist"
    if not resolved.is_relative_to(ROOT):
        return f"{target}: points outside the repository"
    if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
        return f"{target}: no heading with anchor #{anchor} in {resolved.relative_to(ROOT)}"
    return None


@pytest.mark.parametrize("path", PAGES, ids=page_ids())
def test_every_relative_link_points_at_something_that_exists(path):
    p = page(path)
    problems = [problem for target in links(p) if (problem := link_problem(p, target))]
    assert not problems, f"{p.name}: broken links:\n" + "\n".join(problems)


def test_the_index_links_every_page():
    index = page(DOCS / "README.md")
    linked = {(DOCS / t.partition("#")[0]).resolve() for t in links(index) if not t.startswith(("http", "#", "../"))}
    missing = [p.name for p in DOCS.glob("*.md") if p.name != "README.md" and p.resolve() not in linked]
    assert not missing, f"docs/README.md does not link {missing}"


# ------------------------------------------------------------------------------------------------- paths in backticks

def named_paths(p: Page) -> list[str]:
    """The first word of every inline code span that starts with a repository folder, e.g. `scripts/finetune.py`,
    `tests/scaling/`, `scripts/gpu_check.py --only levers` (the script), but not `output_dir/merged`."""
    return [span.split()[0] for span in code_spans(p.prose) if span.startswith(REPO_PREFIXES)]


def path_problem(word: str) -> str | None:
    if placeholder(word) or any(c in word for c in PATTERN_CHARS):
        return None
    target = ROOT / word.split("::")[0]
    if word.endswith("/"):
        return None if target.is_dir() else f"{word}: no such folder"
    return None if target.exists() else f"{word}: no such file"


@pytest.mark.parametrize("path", PAGES, ids=page_ids())
def test_every_repository_path_named_in_backticks_exists(path):
    p = page(path)
    problems = [problem for word in named_paths(p) if (problem := path_problem(word))]
    assert not problems, f"{p.name}:\n" + "\n".join(problems)


def test_no_placeholder_exists():
    """A placeholder that exists in the repository would be checked for nothing: keep the list exact."""
    assert [w for w in PLACEHOLDERS if w != "..." and (ROOT / w).exists()] == []


# ------------------------------------------------------------------------------------------------------------ commands

@dataclasses.dataclass(frozen=True)
class Command:
    page: str
    where: str  # "line N" of the page
    text: str  # as shown (continuations joined, prompt removed)
    words: tuple[str, ...]  # up to the first |, &&, ;, > or comment
    inline: bool  # in backticks in the prose (else a line of a fenced block)


def shell_segments(text: str) -> list[tuple[str, ...]]:
    """The commands of a shell line: split at `&&`, `||` and `;`, each cut at a pipe or a redirection, comments
    (`#` after a space) dropped. A line shlex cannot split (an odd quote) comes back as one word, which no check
    accepts."""
    text = re.sub(r"(^|\s)#.*$", "", text)
    lexer = shlex.shlex(text, posix=True, punctuation_chars="|&;<>")
    lexer.whitespace_split = True
    lexer.commenters = ""
    segments: list[list[str]] = [[]]
    cut = False
    try:
        for word in lexer:
            if word in ("&&", "||", ";"):
                segments.append([])
                cut = False
            elif word in STOPS:
                cut = True
            elif not cut:
                segments[-1].append(word)
    except ValueError as error:
        return [(f"<not a shell line: {error}>",)]
    return [tuple(s) for s in segments if s]


def split_command(text: str) -> tuple[str, ...]:
    """The first command of a shell line (up to the first |, &&, ;, > or comment)."""
    segments = shell_segments(text)
    return segments[0] if segments else ()


def block_commands(p: Page) -> list[Command]:
    """Lines of fenced blocks (not ```python ones): in a block with `$ ` prompts the prompted lines (the rest is
    output), in a block without prompts the lines that start with a command (the rest is output or a table);
    backslash continuations joined."""
    found = []
    for start, info, body in p.blocks:
        if info and info not in ("", "sh", "bash", "shell", "console"):
            continue
        prompted = any(line.lstrip().startswith("$ ") for line in body)
        i = 0
        while i < len(body):
            number, line = start + 1 + i, body[i]
            while line.rstrip().endswith("\\") and i + 1 < len(body):
                i += 1
                line = line.rstrip()[:-1] + " " + body[i].strip()
            i += 1
            stripped = line.strip()
            if prompted:
                if not stripped.startswith("$ "):
                    continue
                stripped = stripped[2:].strip()
            elif not COMMAND_START.match(stripped):
                continue
            if stripped:
                found.append(Command(p.name, f"line {number}", stripped, split_command(stripped), inline=False))
    return found


def inline_commands(p: Page) -> list[Command]:
    found = []
    for match in CODE_SPAN.finditer(p.prose):
        span = " ".join(match.group(2).split())
        span = span[2:] if span.startswith("$ ") else span
        if span == "hf-gpu-train" or span.startswith(("hf-gpu-train ", "python ", "python3 ", "pytest ", "bash ", "sbatch ")):
            number = p.prose.count("\n", 0, match.start()) + 1
            found.append(Command(p.name, f"line {number}", span, split_command(span), inline=True))
    return found


def commands(path: Path) -> list[Command]:
    p = page(path)
    return block_commands(p) + inline_commands(p)


def hf_gpu_train_commands(path: Path) -> list[Command]:
    return [c for c in commands(path) if c.words[:1] == ("hf-gpu-train",) and (c.page, c.text) not in NOT_PARSED]


@functools.cache
def parser():
    from hf_gpu_train.cli import build_parser

    return build_parser()


def parse(argv: list[str]) -> str | None:
    """None when the CLI parser takes ``argv``, else what it said."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser().parse_args(argv)
        except SystemExit as stop:
            if stop.code not in (0, None):
                return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {stop.code}"
    return None


@functools.cache
def help_exit_code(sub: str) -> int:
    from hf_gpu_train.cli import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            return int(main([sub, "--help"]) or 0)
        except SystemExit as stop:
            return int(stop.code or 0)


@functools.cache
def accelerate_launch_parser():
    from accelerate.commands.launch import launch_command_parser  # imports torch: only when a page passes options

    return launch_command_parser()


def file_problems(option: str, value: str | None) -> list[str]:
    if value is None or placeholder(value):
        return []
    if option == "--machine":
        from hf_gpu_train.hardware.snapshot import reference_machine_names

        ok = value in reference_machine_names() or (ROOT / value).is_file()
        return [] if ok else [f"--machine {value}: neither a reference machine nor a file"]
    if option == "--config" and "/" not in value and not value.endswith((".json", ".yml")):
        from hf_gpu_train.finetune.recipe_names import shipped_names

        ok = value.removesuffix(".yaml") in shipped_names() or (ROOT / value).is_file()
        return [] if ok else [f"--config {value}: neither a shipped recipe nor a file"]
    return [] if (ROOT / value).is_file() else [f"{option} {value}: no such file"]


# The fine-tuning entry points: the script of a clone, the module (python -m / accelerate launch -m) of an install.
FINETUNE = ("scripts/finetune.py", "hf_gpu_train.finetune")


def script_problems(words: tuple[str, ...]) -> list[str]:
    """The script exists; for the fine-tuning entry, its --config recipe exists and every key=value is a config key."""
    if not words or placeholder(words[0]):
        return []
    script, args = words[0], words[1:]
    if script not in FINETUNE and not (ROOT / script).is_file():
        return [f"{script}: no such script"]
    problems = []
    for i, arg in enumerate(args):
        if arg == "--config" and i + 1 < len(args):
            problems += file_problems("--config", args[i + 1])
    if script in FINETUNE:
        from hf_gpu_train.finetune.config import RUN_KEYS
        from hf_gpu_train.finetune.tasks import TASKS

        keys = {*RUN_KEYS, *(f.name for task in TASKS.values() for f in dataclasses.fields(task.options))}
        problems += [f"{arg}: {arg.split('=')[0]} is not a key of the fine-tune's config" for arg in args
                     if "=" in arg and not arg.startswith("-") and arg.split("=")[0] not in keys]
    return problems


def launch_problems(sub: str, argv: list[str]) -> list[str]:
    """launch and tune take the rest of the line as it is (argparse REMAINDER): check it as they read it."""
    from hf_gpu_train.plan.accelerate_argv import CONFIG_FILE_OPTIONS, flatten, split_launch_argv

    if not argv:
        return []  # the subcommand named alone, in prose
    problems = []
    if sub == "tune":
        from hf_gpu_train.cli.tune import own_parser, split_tune_argv

        own, argv = split_tune_argv(argv)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                opts = own_parser().parse_args(own)
                problems += file_problems("--machine", opts.machine)
            except SystemExit:
                problems.append(f"tune's own options {own}: {err.getvalue().strip().splitlines()[-1]}")
    if sub == "launch":  # ours, taken out before accelerate's options are read (cli/launch.py)
        from hf_gpu_train.cli.launch import take_nnodes, take_restarts
        from hf_gpu_train.errors import UsageError

        try:
            argv = take_nnodes(take_restarts(argv)[1])[1]
        except UsageError as error:
            return [str(error)]
    parsed = split_launch_argv(argv)
    config = parsed.value(*CONFIG_FILE_OPTIONS)
    if config is None or parsed.script is None:
        return problems + ["--config-file FILE and the training script are required"]
    problems += file_problems("--config-file", config)
    problems += script_problems((parsed.script, *parsed.script_args))
    options = flatten(parsed.without(*CONFIG_FILE_OPTIONS))
    if options:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                accelerate_launch_parser().parse_args([*options, parsed.script])
            except SystemExit:
                problems.append(f"accelerate launch does not take {options}: {err.getvalue().strip().splitlines()[-1]}")
    return problems


def command_problems(command: Command) -> list[str]:
    words = split_command(USAGE_GROUP.sub(" ", command.text))
    sub = words[1] if len(words) > 1 else None
    if sub is None:
        return []  # `hf-gpu-train` alone names the tool
    from hf_gpu_train.cli import SUBCOMMANDS

    if sub not in SUBCOMMANDS:
        return [f"no subcommand {sub!r} (the CLI has {', '.join(SUBCOMMANDS)})"]
    problems = [] if help_exit_code(sub) == 0 else [f"hf-gpu-train {sub} --help exits {help_exit_code(sub)}"]
    if command.inline and len(words) == 2:
        return problems  # `hf-gpu-train config` in a sentence names the subcommand; its arguments are elsewhere
    if (said := parse(list(words[1:]))) is not None:
        problems.append(said)
    if sub in ("launch", "tune"):
        problems += launch_problems(sub, list(words[2:]))
    elif sub == "finetune":
        problems += script_problems(("hf_gpu_train.finetune", *words[2:]))
    else:
        args = list(words[2:])
        for i, arg in enumerate(args[:-1]):
            if arg == "--machine":
                problems += file_problems("--machine", args[i + 1])
    return problems


@pytest.mark.parametrize("path", PAGES, ids=page_ids())
def test_every_hf_gpu_train_command_parses(path):
    problems = [f"{c.page} {c.where}: `{c.text}`: {problem}" for c in hf_gpu_train_commands(path)
                for problem in command_problems(c)]
    assert not problems, "\n".join(problems)


def other_command_problems(command: Command) -> list[str]:
    words = list(command.words)
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value before the command
        words.pop(0)
    if not words:
        return []
    if words[0].startswith("<not a shell line"):
        return [words[0]]
    tool = words[0].rsplit("/", 1)[-1]
    if re.fullmatch(r"python(3(\.\d+)?)?", tool):
        if words[1:3] == ["-m", "hf_gpu_train.finetune"]:
            return script_problems(tuple(words[2:]))
        return [] if len(words) < 2 or words[1].startswith("-") else script_problems(tuple(words[1:]))
    if tool == "pytest":
        return [f"{w}: no such test path" for w in words[1:] if w.startswith("tests/") and not (ROOT / w.split("::")[0]).exists()]
    if tool in ("bash", "sbatch"):
        if len(words) < 2:
            return []
        if not (ROOT / words[1]).is_file():
            return [f"{words[1]}: no such script"]
        # a generated .sbatch runs HF_GPU_TRAIN_SCRIPT with the arguments after the .sbatch's name
        runs = re.search(r"HF_GPU_TRAIN_SCRIPT=(\S+\.py)", (ROOT / words[1]).read_text()) if tool == "sbatch" else None
        return script_problems((runs.group(1), *words[2:])) if runs else []
    if tool == "accelerate" and words[1:2] == ["launch"]:
        from hf_gpu_train.plan.accelerate_argv import CONFIG_FILE_OPTIONS, split_launch_argv

        parsed = split_launch_argv(words[2:])
        return file_problems("--config-file", parsed.value(*CONFIG_FILE_OPTIONS)) + script_problems(
            (parsed.script, *parsed.script_args) if parsed.script else ())
    return []


@pytest.mark.parametrize("path", PAGES, ids=page_ids())
def test_every_other_command_names_files_that_exist(path):
    """python / pytest / bash / sbatch / accelerate launch: the scripts, tests, recipes and configs they name."""
    problems = [f"{c.page} {c.where}: `{c.text}`: {problem}" for c in commands(path)
                for words in shell_segments(c.text)  # each command of `a && b`
                for problem in other_command_problems(dataclasses.replace(c, words=words))]
    assert not problems, "\n".join(problems)


def test_the_exclusions_are_still_needed():
    """Every command excluded from parsing is still on its page and still does not parse."""
    for (name, text), reason in NOT_PARSED.items():
        shown = [c for c in commands(ROOT / name) if c.text == text]
        assert shown, f"{name} no longer shows `{text}` ({reason}): drop it from NOT_PARSED"
        assert all(command_problems(c) for c in shown), f"`{text}` parses now: drop it from NOT_PARSED"


def test_the_pages_show_commands_at_all():
    """A guard on the extraction itself: the pages are known to show these."""
    every = [c.text for p in PAGES for c in hf_gpu_train_commands(p)]
    assert any(t.startswith("hf-gpu-train plan-memory ") for t in every)
    assert any(t.startswith("hf-gpu-train launch --config-file ") for t in every)
    assert any(t.startswith("hf-gpu-train tune ") for t in every)
    assert len(every) >= 20


def test_every_placeholder_is_used():
    """Run every check over every page and see each placeholder met at least once: an unused one is dropped."""
    USED.clear()
    for path in PAGES:
        p = page(path)
        [path_problem(word) for word in named_paths(p)]
        [command_problems(c) for c in hf_gpu_train_commands(path)]
        [other_command_problems(dataclasses.replace(c, words=w)) for c in commands(path) for w in shell_segments(c.text)]
    assert set(PLACEHOLDERS) - USED == set()
