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


def test_the_layers_read_one_way():
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "hf_gpu_train"
    found = []
    for layer, above in FORBIDDEN.items():
        for path in sorted((package / layer).rglob("*.py")):
            depth = len(path.relative_to(package).parts) - 1  # how many dots reach the package
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level:
                    parts = path.relative_to(package).parts[:-1][:max(0, depth - (node.level - 1))]
                    target = ".".join([*parts, *(node.module.split(".") if node.module else [])])
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hf_gpu_train."):
                    target = node.module.removeprefix("hf_gpu_train.")
                else:
                    continue
                if target.split(".")[0] in above:
                    found.append(f"{path.relative_to(package)}:{node.lineno} imports {target}")
    assert not found, "\n".join(found)
