"""The report's section of generation samples (``generations.json``, written by a causal-LM run): held-out prompts
answered before and after training, beside the reference."""

from __future__ import annotations

import json
from pathlib import Path

GENERATIONS = "generations.json"
SECTION = "## Generation samples"


def render_generations(records: list[dict]) -> list[str]:
    lines = [SECTION, "", "Held-out prompts from the validation split, greedy decoding (`generations.json`).", ""]
    for i, r in enumerate(records, 1):
        lines += [f"### Sample {i}", "", "**Prompt:**", "", _quote(r["prompt"]), "", "**Reference:**", "", _quote(r["reference"]),
                  "", "**Before training:**", "", _quote(r["before"]), "", "**After training:**", "", _quote(r["after"]), ""]
    return lines


def generations_section(output_dir: Path) -> list[str]:
    path = Path(output_dir) / GENERATIONS
    return render_generations(json.loads(path.read_text())["samples"]) if path.is_file() else []


def _quote(text: str | None) -> str:
    return "\n".join(f"> {line}" for line in (text if text is not None else "(not generated)").splitlines() or [""])
