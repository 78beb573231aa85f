"""The code stays lint-clean (ruff, configured in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff not installed (pip install -e '.[dev]')")
    result = subprocess.run([ruff, "check", "hf_gpu_train", "tests", "scripts", "benchmarks"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout


# The layers, lowest first: a module imports (at its top or inside a function) only from its own layer and below.
# report/ renders files a run left and must not reach back into the callbacks that write them; the planner (launch/)
# serves any training script and must not need the fine-tuning entry point.
FORBIDDEN = {
    "hardware": ("launch", "finetune", "callbacks", "training", "report", "tune", "cli"),
    "launch": ("finetune", "callbacks", "training", "report", "tune", "cli"),
    "report": ("finetune", "callbacks", "training", "tune", "cli"),
}


def imported_modules(path: Path, package: Path) -> list[tuple[int, str]]:
    """(line, module path below the package) of every import in ``path``, at its top or inside a function: ``from .x
    import y`` and ``from .. import x`` (each name, which may be a module), ``import hf_gpu_train.x``, and
    ``importlib.import_module("hf_gpu_train.x")``."""
    import ast

    here = path.relative_to(package).parts[:-1]  # the module's package, below hf_gpu_train
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = [*here[:max(0, len(here) - (node.level - 1))], *(node.module.split(".") if node.module else [])]
            elif (node.module or "").split(".")[0] == "hf_gpu_train":
                base = node.module.split(".")[1:]
            else:
                continue
            found += [(node.lineno, ".".join([*base, alias.name])) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.removeprefix("hf_gpu_train.")) for alias in node.names
                      if alias.name.startswith("hf_gpu_train.")]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and node.args[0].value.startswith("hf_gpu_train.")):
            found.append((node.lineno, node.args[0].value.removeprefix("hf_gpu_train.")))
    return found


def test_the_layers_read_one_way():
    package = Path(__file__).resolve().parents[1] / "hf_gpu_train"
    found = []
    for layer, above in FORBIDDEN.items():
        for path in sorted((package / layer).rglob("*.py")):
            for line, target in imported_modules(path, package):
                if target.split(".")[0] in above:
                    found.append(f"{path.relative_to(package)}:{line} imports {target}")
    assert not found, "\n".join(found)


def test_every_spelling_of_an_import_is_seen(tmp_path):
    package = tmp_path / "hf_gpu_train"
    (package / "report" / "sub").mkdir(parents=True)
    module = package / "report" / "sub" / "m.py"
    module.write_text("from ... import callbacks\nfrom ...finetune.run import main\nfrom . import sibling\n"
                      "import hf_gpu_train.tune.search\nfrom hf_gpu_train.cli import main\n"
                      "def f():\n    import importlib\n    return importlib.import_module('hf_gpu_train.training.oom')\n")
    assert [t for _, t in imported_modules(module, package)] == ["callbacks", "finetune.run.main", "report.sub.sibling",
                                                                  "tune.search", "cli.main", "training.oom"]
