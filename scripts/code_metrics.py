"""Measure the shape of the package: what a newcomer meets when finding their way in it.

    python scripts/code_metrics.py [PACKAGE_DIR]

Prints modules and lines per folder, import circles between modules, imports that reach up a layer, the longest
functions, the branches on a task name (``task ==`` / ``task !=``), imports inside functions, how many files a
new task would have to touch (the files that branch on a task name, plus the task's own module), the tests of a
strategy by its name outside the strategy table, the reads of a task's capability flags outside ``finetune/tasks/``,
and the files the run's whole config reaches (every module with a function that receives it). Issues 29's and 37's
closing notes give these figures before and after; ``tests/test_code_quality.py`` holds the lines that must stay (no
circles, no upward import, imports at the top, the strategies read from their table).
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The layers, lowest first. A module imports from its own layer and below. Folders of one rank are peers.
LAYERS: dict[str, int] = {
    "": 0,  # the package's top-level modules (errors, textfmt, svg, ...)
    "hardware": 1,
    "collectives": 1,  # what every rank does together: below oom/ and faults/, which both use it
    "doctor": 2,
    "plan": 2,  # the planner, the levers' planning included (plan/lever_table.py, plan/lever_plan.py)
    "levers": 3,  # where each lever is applied in a run: reads the planner's shape of a step, never the other way
    # from a plan to processes, and what runs inside anyone's Trainer; none of them needs the planner to know it
    "launch": 3, "oom": 3, "faults": 3,
    "report": 3,  # renders files a run left: never reaches back into the callbacks that write them
    "callbacks": 4,
    "finetune": 5,
    "tune": 6,
    "cli": 7,
}

# The strategy names and their families as the planner writes them (plan/strategies.py's rows: tests/test_code_quality.py
# holds the two equal). Written out here so that a tree from before the table is measured the same way.
STRATEGY_NAMES = frozenset({
    "single", "ddp", "fsdp", "fsdp-shard-grad-op", "fsdp-offload", "deepspeed-zero2", "deepspeed-zero3",
    "deepspeed-zero2-offload", "deepspeed-zero3-offload", "cpu", "cpu-ddp", "cpu-fsdp",
})
STRATEGY_FAMILIES = ("fsdp", "deepspeed")  # startswith("fsdp"), family == "deepspeed"
STRATEGY_TABLE = "plan/strategies.py"

TASK_BRANCH = re.compile(r"\btask\s*[!=]=|[!=]=\s*task\b|\btask\s+(?:not\s+)?in\s|[\"']task[\"']\]?\)?\s*[!=]=")


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def package_targets(node: ast.AST, here: tuple[str, ...]) -> list[str] | None:
    """The module paths below the package that an import statement names (``from .x import y``, ``from .. import x``:
    each name, which may be a module; ``import hf_gpu_train.x``), from a module in the package ``here``; None for an
    import of anything else."""
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = [*here[:max(0, len(here) - (node.level - 1))], *(node.module.split(".") if node.module else [])]
        elif (node.module or "").split(".")[0] == "hf_gpu_train":
            base = node.module.split(".")[1:]
        else:
            return None
        return [".".join([*base, alias.name]) for alias in node.names]
    if isinstance(node, ast.Import):
        found = [alias.name.removeprefix("hf_gpu_train.") for alias in node.names if alias.name.startswith("hf_gpu_train.")]
        return found or None
    return None


def imported_modules(path: Path, package: Path, *, top_level_only: bool = False) -> list[tuple[int, str]]:
    """(line, module path below the package) of every import in ``path``, at its top or inside a function (or at its
    top only): ``package_targets`` of each import statement, and ``importlib.import_module("hf_gpu_train.x")``."""
    here = path.relative_to(package).parts[:-1]  # the module's package, below hf_gpu_train
    found = []
    nodes = _top_level_imports(path) if top_level_only else ast.walk(ast.parse(path.read_text()))
    for node in nodes:
        targets = package_targets(node, here)
        if targets is not None:
            found += [(node.lineno, target) for target in targets]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and node.args[0].value.startswith("hf_gpu_train.")):
            found.append((node.lineno, node.args[0].value.removeprefix("hf_gpu_train.")))
    return found


def function_nodes(path: Path, tree: ast.AST | None = None) -> list[ast.AST]:
    """The outermost functions of ``path`` (methods included; nested functions are inside their parent), in ``tree``
    when given (the module already parsed: nodes of one tree are compared with nodes of the same tree)."""
    tree = ast.parse(path.read_text()) if tree is None else tree
    found: list[ast.AST] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append(child)
            else:
                visit(child)

    visit(tree)
    return found


def imports_inside_functions(path: Path) -> list[tuple[int, str]]:
    """(line, what) of every import statement inside a function of ``path``."""
    found = []
    for function in function_nodes(path):
        for node in ast.walk(function):
            if isinstance(node, ast.Import):
                found.append((node.lineno, ", ".join(a.name for a in node.names)))
            elif isinstance(node, ast.ImportFrom):
                found.append((node.lineno, "." * node.level + (node.module or "")))
    return found


def resolve(target: str, modules: set[str]) -> str | None:
    """The package module ``target`` names (``a.b.name`` may be module ``a.b`` with a name in it)."""
    while target:
        if target in modules:
            return target
        target = target.rpartition(".")[0]
    return None


def import_graph(package: Path) -> dict[str, set[str]]:
    paths = sorted(package.rglob("*.py"))
    modules = {module_name(p, package) for p in paths}
    graph: dict[str, set[str]] = defaultdict(set)
    for path in paths:
        source = module_name(path, package)
        graph[source]
        for _, target in imported_modules(path, package):
            found = resolve(target, modules)
            # A package's __init__ is not an edge of its own submodules' circles: `from . import x` names x.
            if found and found != source and not source.startswith(found + "."):
                graph[source].add(found)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def connect(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def folder_of(module: str, package: Path) -> str:
    first = module.split(".")[0]
    return first if (package / first).is_dir() else ""


def upward_imports(package: Path) -> list[str]:
    found = []
    modules = {module_name(p, package) for p in package.rglob("*.py")}
    for path in sorted(package.rglob("*.py")):
        source = module_name(path, package)
        if source in ("", "__main__"):
            continue  # the package's face (hf_gpu_train/__init__, __main__) sits above every layer
        here = LAYERS.get(folder_of(source, package))
        for line, target in imported_modules(path, package):
            found_module = resolve(target, modules)
            if found_module is None or here is None:
                continue
            there = LAYERS.get(folder_of(found_module, package))
            if there is not None and there > here:
                found.append(f"{path.relative_to(package)}:{line} imports {found_module}")
    return found


def longest_functions(package: Path, count: int = 8) -> list[tuple[int, str]]:
    found = []
    for path in sorted(package.rglob("*.py")):
        for function in function_nodes(path):
            length = function.end_lineno - function.lineno + 1
            found.append((length, f"{path.relative_to(package)}:{function.name}"))
    return sorted(found, reverse=True)[:count]


def task_branches(package: Path) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            branches = [m for m in TASK_BRANCH.finditer(code) if not re.search(r"\bfor\b", code[:m.start()])]  # a loop
            found += [f"{path.relative_to(package)}:{number}"] * len(branches)
    return found


def _names_a_strategy(node: ast.AST) -> bool:
    """A string naming a strategy or a family; "cpu" alone is not counted: it is a device's type far more often."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return (node.value in STRATEGY_NAMES and node.value != "cpu") or node.value in STRATEGY_FAMILIES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_strategy(e) for e in node.elts)
    return False


def strategy_string_tests(package: Path) -> tuple[list[str], list[str]]:
    """(the comparisons of a value with a strategy's name or family, ``==``/``!=``/``in``/``startswith``; the tuples
    and sets of two or more strategy names bound to a name), outside the strategy table: each is a place a new strategy
    must be found in. A comparison of a key named "strategy"'s value with another key is not one (no name in it)."""
    tests, groups = [], []
    for path in sorted(package.rglob("*.py")):
        where = str(path.relative_to(package))
        if where == STRATEGY_TABLE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
                if any(_names_a_strategy(side) for side in (node.left, *node.comparators)):
                    tests.append(f"{where}:{node.lineno}")
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("startswith", "endswith")
                  and node.args and _names_a_strategy(node.args[0])):
                tests.append(f"{where}:{node.lineno}")
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, (ast.Tuple, ast.Set, ast.List, ast.Call)):
                value = node.value.args[0] if isinstance(node.value, ast.Call) and node.value.args else node.value
                names = [e for e in getattr(value, "elts", ()) if isinstance(e, ast.Constant) and e.value in STRATEGY_NAMES]
                if len(names) >= 2:
                    groups.append(f"{where}:{node.lineno}")
    return tests, groups


def task_flag_reads(package: Path) -> list[str]:
    """Reads of a task's capability flags (the boolean class attributes of ``finetune/tasks/base.py``'s ``Task``)
    outside ``finetune/tasks/``: each is a branch a new task's flags must be right for."""
    base = package / "finetune" / "tasks" / "base.py"
    if not base.exists():
        return []
    flags = set()
    for node in ast.walk(ast.parse(base.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == "Task":
            for item in node.body:
                if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                        and "bool" in ast.unparse(item.annotation)):
                    flags.add(item.target.id)
    found = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package)
        if where.parts[:2] == ("finetune", "tasks"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in flags and isinstance(node.ctx, ast.Load):
                found.append(f"{where}:{node.lineno}")
    return found


def config_walk(package: Path) -> list[str]:
    """The modules the run's whole config reaches: those with a function that receives it (a parameter named ``cfg``
    or annotated ``FinetuneConfig``). A stage given only the keys it reads (``cfg.data_keys()``, ``cfg.options``, a
    value) is not one."""
    found = set()
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if any(a.arg == "cfg" or "FinetuneConfig" in ast.unparse(a.annotation or ast.Constant(""))
                       for a in arguments):
                    found.add(str(path.relative_to(package)))
    return sorted(found)


def measure(package: Path) -> dict:
    per_folder: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for path in package.rglob("*.py"):
        folder = path.relative_to(package).parts[0] if len(path.relative_to(package).parts) > 1 else "(top)"
        per_folder[folder][0] += 1
        per_folder[folder][1] += len(path.read_text().splitlines())
    inside = {str(p.relative_to(package)): imports_inside_functions(p) for p in sorted(package.rglob("*.py"))}
    branches = task_branches(package)
    return {
        "per_folder": dict(sorted(per_folder.items())),
        "circles": circles(import_graph(package)),
        "upward": upward_imports(package),
        "longest": longest_functions(package),
        "task_branches": branches,
        "imports_inside_functions": sum(len(v) for v in inside.values()),
        # the files that branch on a task name, the task's own module, and the registry's import of it where tasks
        # are registered (finetune/tasks/__init__.py, as timm's models/__init__.py imports each model module)
        "files_a_new_task_touches": len({b.split(":")[0] for b in branches}) + 1 + (package / "finetune" / "tasks").is_dir(),
        "strategy_tests": strategy_string_tests(package),
        "task_flag_reads": task_flag_reads(package),
        "config_walk": config_walk(package),
    }


def main(argv: list[str]) -> int:
    package = Path(argv[0]) if argv else ROOT / "hf_gpu_train"
    figures = measure(package)
    total = [sum(v[0] for v in figures["per_folder"].values()), sum(v[1] for v in figures["per_folder"].values())]
    print(f"modules and lines per folder ({total[0]} modules, {total[1]} lines):")
    for folder, (modules, lines) in figures["per_folder"].items():
        print(f"  {folder:<12} {modules:>4} modules {lines:>6} lines")
    print(f"import circles: {len(figures['circles'])}")
    for circle in figures["circles"]:
        print("  " + " <-> ".join(circle))
    print(f"upward imports: {len(figures['upward'])}")
    for line in figures["upward"]:
        print("  " + line)
    print("longest functions:")
    for length, name in figures["longest"]:
        print(f"  {length:>4} lines  {name}")
    print(f"task branches (task == / != / in): {len(figures['task_branches'])} in "
          f"{len({b.split(':')[0] for b in figures['task_branches']})} files")
    print(f"imports inside functions: {figures['imports_inside_functions']}")
    print(f"files a new task touches: {figures['files_a_new_task_touches']}")
    tests, groups = figures["strategy_tests"]
    print(f"strategy names tested outside {STRATEGY_TABLE}: {len(tests)} in {len({t.split(':')[0] for t in tests})} files; "
          f"tuples of strategy names: {len(groups)}")
    for line in groups:
        print("  tuple " + line)
    reads = figures["task_flag_reads"]
    print(f"task capability flags read outside finetune/tasks/: {len(reads)} in {len({r.split(':')[0] for r in reads})} files")
    print(f"files the run's whole config reaches: {len(figures['config_walk'])} "
          f"in {len({w.split('/')[0] for w in figures['config_walk']})} folders")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))


# What may stay inside a function: start-up time (`hf-gpu-train detect` and `--help` import no torch) and optional
# dependencies. A third-party import, or a package module that imports one of these at its top (directly or through
# other package modules), or a line marked `# lazy: why`. Everything else goes at the top of its module.
HEAVY_THIRD_PARTY = frozenset({
    "torch", "transformers", "accelerate", "timm", "datasets", "peft", "trl", "deepspeed", "evaluate", "bitsandbytes",
    "liger_kernel", "cut_cross_entropy", "safetensors", "torchvision", "PIL", "numpy", "scipy", "sklearn", "pyarrow",
    "huggingface_hub", "tokenizers", "gguf", "ray", "tensorboard", "efficientnet_pytorch", "pandas", "jinja2",
})
LAZY_MARK = re.compile(r"#\s*lazy:")


def _top_level_imports(path: Path) -> list[ast.AST]:
    tree = ast.parse(path.read_text())
    inside = {id(n) for f in function_nodes(path, tree) for n in ast.walk(f)}  # ids of live nodes of this one tree
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in inside]


def heavy_modules(package: Path) -> set[str]:
    """Package modules that import a heavy third-party package when they are imported (directly or through other
    package modules, the packages' __init__ included)."""
    paths = {module_name(p, package): p for p in package.rglob("*.py")}
    direct: dict[str, set[str]] = {}
    heavy: set[str] = set()
    for name, path in paths.items():
        direct[name] = set()
        for node in _top_level_imports(path):
            if isinstance(node, ast.Import):
                tops = [a.name.split(".")[0] for a in node.names]
            else:
                tops = [(node.module or "").split(".")[0]] if not node.level else []
            if any(t in HEAVY_THIRD_PARTY for t in tops):
                heavy.add(name)
        for _, target in imported_modules(path, package, top_level_only=True):
            found = resolve(target, set(paths))
            if found:
                direct[name].add(found)
                parts = found.split(".")
                direct[name].update(".".join(parts[:k]) for k in range(1, len(parts)) if ".".join(parts[:k]) in paths)
    changed = True
    while changed:
        changed = False
        for name, targets in direct.items():
            if name not in heavy and targets & heavy:
                heavy.add(name)
                changed = True
    return heavy


def must_be_at_top(node: ast.AST, path: Path, package: Path, heavy: set[str], lines: list[str], modules: set[str]) -> bool:
    """Whether an import found inside a function of ``path`` has no reason to be there (``modules``: the package's)."""
    text = " ".join(lines[node.lineno - 1:node.end_lineno])
    if LAZY_MARK.search(text) or (node.lineno > 1 and LAZY_MARK.search(lines[node.lineno - 2])):
        return False
    targets = package_targets(node, path.relative_to(package).parts[:-1])
    if targets is None:  # a third-party import (heavy or optional) may stay; a standard library one goes to the top
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        return all(name.split(".")[0] in sys.stdlib_module_names for name in names)
    for target in targets:
        found = resolve(target, modules)
        if found is None:
            continue
        parts = found.split(".")
        if any(".".join(parts[:k]) in heavy for k in range(1, len(parts) + 1)):
            return False
    return True


def imports_that_belong_at_the_top(package: Path) -> list[str]:
    heavy = heavy_modules(package)
    modules = {module_name(p, package) for p in package.rglob("*.py")}
    found = []
    for path in sorted(package.rglob("*.py")):
        lines = path.read_text().splitlines()
        for function in function_nodes(path):
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and must_be_at_top(node, path, package, heavy, lines,
                                                                                      modules):
                    found.append(f"{path.relative_to(package)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found
