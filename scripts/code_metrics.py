"""Measure the shape of the package: what a newcomer meets when finding their way in it.

    python scripts/code_metrics.py [PACKAGE_DIR]

Prints modules and lines per folder, import circles between modules, imports that reach up a layer, the longest
functions, the branches on a task name (``task ==`` / ``task !=``), imports inside functions, and how many files a
new task would have to touch (the files that branch on a task name, plus the task's own module). Issue 29's closing
note gives these figures before and after the layout by concept; ``tests/test_code_quality.py`` holds the lines
that must stay (no circles, no upward import, imports at the top).
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
            found += [f"{path.relative_to(package)}:{number}"] * len(TASK_BRANCH.findall(code))
    return found


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
