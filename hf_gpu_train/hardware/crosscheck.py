"""Compare our detection with ``nvidia-smi`` on a real machine (used by ``scripts/gpu_check.py``).

Parsing lives here, not in the script, so the tests can hold it to real ``nvidia-smi`` outputs.
"""

from __future__ import annotations

import csv
import io
import re

from .backend import normalize_bus_id
from .profile import HardwareProfile

QUERY_FIELDS = "index,name,uuid,pci.bus_id,memory.total,compute_cap"


def parse_query_csv(text: str) -> list[dict[str, str]]:
    """``nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,memory.total,compute_cap --format=csv``."""
    rows = list(csv.reader(io.StringIO(text.strip()), skipinitialspace=True))
    if not rows:
        return []
    header = [re.sub(r"\s*\[.*\]", "", h).strip() for h in rows[0]]
    return [dict(zip(header, (c.strip() for c in row))) for row in rows[1:] if row]


def parse_topo_matrix(text: str) -> dict[tuple[int, int], str]:
    """``nvidia-smi topo -m``: {(i, j): "NV18" | "PIX" | ...} for GPU pairs i < j (NIC rows ignored)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return {}
    columns = lines[0].split()
    gpu_columns = [c for c in columns if re.fullmatch(r"GPU\d+", c)]
    cells: dict[tuple[int, int], str] = {}
    for line in lines[1:]:
        parts = line.split()
        if not parts or not re.fullmatch(r"GPU\d+", parts[0]):
            continue
        a = int(parts[0][3:])
        for name, value in zip(gpu_columns, parts[1:]):
            b = int(name[3:])
            if a < b:
                cells[(a, b)] = value
    return cells


def compare(profile: HardwareProfile, query_rows: list[dict[str, str]], topo: dict[tuple[int, int], str]) -> list[str]:
    """Every difference between our profile and nvidia-smi, as readable lines (empty: all agree)."""
    mismatches = []
    if len(query_rows) != len(profile.gpus):
        mismatches.append(f"GPU count: nvidia-smi {len(query_rows)}, hf-gpu-train {len(profile.gpus)}")
    ours = {g.index: g for g in profile.gpus}
    for row in query_rows:
        index = int(row["index"])
        gpu = ours.get(index)
        if gpu is None:
            mismatches.append(f"GPU{index}: missing from hf-gpu-train detect")
            continue
        theirs_mib = int(row["memory.total"].split()[0])
        checks = [
            ("name", row["name"], gpu.name),
            ("uuid", row["uuid"], gpu.uuid),
            ("pci.bus_id", normalize_bus_id(row["pci.bus_id"]), gpu.pci_bus_id),
            ("memory.total MiB", theirs_mib, gpu.memory_total_bytes // 2**20),
            ("compute_cap", row["compute_cap"], gpu.capability_str),
        ]
        for field, theirs, mine in checks:
            if theirs != mine:
                mismatches.append(f"GPU{index} {field}: nvidia-smi {theirs!r}, hf-gpu-train {mine!r}")
    for (a, b), theirs in sorted(topo.items()):
        pair = profile.pair(a, b)
        mine = pair.label if pair else None
        if theirs != mine:
            mismatches.append(f"topology GPU{a}-GPU{b}: nvidia-smi {theirs}, hf-gpu-train {mine}")
    return mismatches
