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


def code_metrics():
    """scripts/code_metrics.py, the one reading of the package's imports (the closing notes' figures come from it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("code_metrics", ROOT / "scripts" / "code_metrics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


METRICS = code_metrics()
imported_modules = METRICS.imported_modules


def test_the_layers_read_one_way():
    """A module imports (at its top or inside a function) only from its own layer and below (the layers are
    ``LAYERS`` in scripts/code_metrics.py): report/ renders files a run left and must not reach back into the
    callbacks that write them; the planner serves any training script and must not need the fine-tuning entry point."""
    package = ROOT / "hf_gpu_train"
    assert set(METRICS.LAYERS) >= {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    assert not METRICS.upward_imports(package), "\n".join(METRICS.upward_imports(package))


def test_no_module_imports_itself_in_a_circle():
    circles = METRICS.circles(METRICS.import_graph(ROOT / "hf_gpu_train"))
    assert not circles, circles


def test_a_circle_and_an_upward_import_are_seen(tmp_path):
    package = tmp_path / "hf_gpu_train"
    for folder in ("plan", "finetune"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "plan" / "a.py").write_text("from ..finetune import b\n")
    (package / "finetune" / "b.py").write_text("def f():\n    from ..plan import a\n")
    assert METRICS.circles(METRICS.import_graph(package)) == [["finetune.b", "plan.a"]]
    assert METRICS.upward_imports(package) == ["plan/a.py:1 imports finetune.b"]


def test_the_layers_keep_the_report_below_the_callbacks_and_the_planner_below_what_runs(tmp_path):
    package = tmp_path / "hf_gpu_train"
    for folder in ("report", "callbacks", "plan", "oom", "faults", "levers"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "report" / "r.py").write_text("from ..callbacks import telemetry\n")
    (package / "plan" / "p.py").write_text("from ..oom import recovery\nfrom ..faults import watchdog\nfrom ..levers import table\n")
    assert METRICS.upward_imports(package) == ["plan/p.py:1 imports oom", "plan/p.py:2 imports faults",
                                               "plan/p.py:3 imports levers", "report/r.py:1 imports callbacks"]


def test_every_spelling_of_an_import_is_seen(tmp_path):
    package = tmp_path / "hf_gpu_train"
    (package / "report" / "sub").mkdir(parents=True)
    module = package / "report" / "sub" / "m.py"
    module.write_text("from ... import callbacks\nfrom ...finetune.run import main\nfrom . import sibling\n"
                      "import hf_gpu_train.tune.search\nfrom hf_gpu_train.cli import main\n"
                      "def f():\n    import importlib\n    return importlib.import_module('hf_gpu_train.oom.recovery')\n")
    assert [t for _, t in imported_modules(module, package)] == ["callbacks", "finetune.run.main", "report.sub.sibling",
                                                                  "tune.search", "cli.main", "oom.recovery"]


def test_imports_are_at_the_top_unless_start_up_needs_them_lazy():
    """An import inside a function is for start-up time (`hf-gpu-train detect` and `--help` import no torch) or an
    optional dependency: a third-party package, or a package module that imports a heavy one at its top; anything
    else is marked ``# lazy: why`` or goes at the top of its module (``must_be_at_top`` in scripts/code_metrics.py)."""
    found = METRICS.imports_that_belong_at_the_top(ROOT / "hf_gpu_train")
    assert not found, "\n".join(found)


def test_the_import_rule_tells_a_needed_lazy_import_from_a_needless_one(tmp_path):
    package = tmp_path / "hf_gpu_train"
    (package / "plan").mkdir(parents=True)
    (package / "plan" / "__init__.py").write_text("")
    (package / "plan" / "heavy.py").write_text("import torch\n")
    (package / "plan" / "light.py").write_text("import json\n")
    (package / "plan" / "user.py").write_text(
        "def f():\n    import json\n    import torch\n    from . import heavy\n    from .light import json as j\n"
        "    from .light import json as k  # lazy: a reason\n")
    assert METRICS.imports_that_belong_at_the_top(package) == ["plan/user.py:2: import json",
                                                               "plan/user.py:5: from .light import json as j"]


def test_an_import_inside_a_function_is_never_read_as_one_at_the_top(tmp_path):
    """The top-level imports are told from the ones inside functions in one parse of the module (two parses compared
    node ids of different trees: freed ids came back, and a lazy import made its module heavy at random)."""
    package = tmp_path / "hf_gpu_train"
    (package / "plan").mkdir(parents=True)
    (package / "plan" / "__init__.py").write_text("")
    body = "".join(f"import json as j{i}\n" for i in range(40))
    body += "".join(f"def f{i}():\n    import torch\n    import json as k{i}\n" for i in range(200))
    (package / "plan" / "lazy.py").write_text(body)
    for _ in range(5):
        top = METRICS._top_level_imports(package / "plan" / "lazy.py")
        assert sorted(n.lineno for n in top) == list(range(1, 41))
        assert "plan.lazy" not in METRICS.heavy_modules(package)


def test_the_strategies_are_read_from_their_table():
    """A new strategy is a row of plan/strategies.py (and its renderer): no module tests a strategy by its name or
    keeps its own tuple of names. The metric's list of names is the table's."""
    from hf_gpu_train.plan.strategies import CPU_STRATEGIES, STRATEGIES

    assert METRICS.STRATEGY_NAMES == set(STRATEGIES) | set(CPU_STRATEGIES)
    tests, groups = METRICS.strategy_string_tests(ROOT / "hf_gpu_train")
    assert not tests and not groups, "\n".join(tests + groups)


def test_the_strategy_metric_sees_a_test_a_prefix_and_a_tuple(tmp_path):
    package = tmp_path / "hf_gpu_train"
    (package / "plan").mkdir(parents=True)
    (package / "plan" / "strategies.py").write_text("A = ('ddp', 'fsdp')\n")  # the table itself may name them
    (package / "plan" / "m.py").write_text(
        "SHARDED = ('fsdp', 'deepspeed-zero3')\nif s == 'ddp' or s.startswith('deepspeed') or s in ('fsdp',):\n    pass\n"
        "if device.type == 'cpu':\n    pass\n")
    assert METRICS.strategy_string_tests(package) == (["plan/m.py:2", "plan/m.py:2", "plan/m.py:2"], ["plan/m.py:1"])


def test_the_whole_config_reaches_at_most_twenty_modules():
    """Each stage is given what it reads (``cfg.data_keys()``, ``cfg.options``, ``cfg.lever_keys()``, values): the
    modules with a function that receives the whole config stay few (issue 37: 33 before)."""
    walk = METRICS.config_walk(ROOT / "hf_gpu_train")
    assert len(walk) <= 20, "\n".join(walk)
    assert not [w for w in walk if w.split("/")[0] not in ("finetune", "tune")], walk
