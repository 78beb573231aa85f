"""Render GPU topology the way ``nvidia-smi topo -m`` does, plus a P2P line."""

from __future__ import annotations

from .profile import HardwareProfile


def topology_matrix(profile: HardwareProfile) -> list[list[str]]:
    """Rows of cells: header row, then one row per GPU with X on the diagonal."""
    gpus = profile.gpus
    header = [""] + [f"GPU{g.index}" for g in gpus] + ["CPU Affinity", "NUMA"]
    rows = [header]
    for a in gpus:
        row = [f"GPU{a.index}"]
        for b in gpus:
            if a.index == b.index:
                row.append("X")
            else:
                pair = profile.pair(a.index, b.index)
                row.append(pair.label if pair else "?")
        row += [a.cpu_affinity or "?", "?" if a.numa_node is None else str(a.numa_node)]
        rows.append(row)
    return rows


def p2p_summary(profile: HardwareProfile) -> str:
    """One line: which pairs can talk peer-to-peer, and why the others cannot."""
    if len(profile.gpus) < 2:
        return "P2P: single GPU, nothing to check"
    ok = [p for p in profile.pairs if p.p2p_ok]
    bad = [p for p in profile.pairs if not p.p2p_ok]
    if not bad:
        return f"P2P: OK on all {len(ok)} pairs"
    reasons: dict[str, list[str]] = {}
    for p in bad:
        reason = p.p2p_read if p.p2p_read != "OK" else p.p2p_write
        reasons.setdefault(reason or "unknown", []).append(f"{p.a}-{p.b}")
    parts = [f"{reason} on {', '.join(pairs)}" for reason, pairs in reasons.items()]
    return f"P2P: OK on {len(ok)} of {len(profile.pairs)} pairs; " + "; ".join(parts)


LEGEND = (
    "Legend: X self, SYS crosses the NUMA interconnect, NODE host bridges within one NUMA node, "
    "PHB one host bridge, PXB several PCIe bridges, PIX at most one PCIe bridge, NV# bonded NVLinks"
)
