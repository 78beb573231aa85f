"""A picture of how a machine's GPUs reach each other: ``hf-gpu-train detect --topology-svg topo.svg``.

The same facts as ``detect``'s ``nvidia-smi topo -m`` matrix, read from the same place (``HardwareProfile.pairs``:
each pair's ``label``, NV# winning over the PCIe path, and NVML's P2P status), drawn as SVG text like the run report's
charts (``hf_gpu_train/svg.py``): no matplotlib, no torch, so ``detect`` stays fast and runs on a login node.

What the picture shows, and why it is drawn this way:

- Each GPU is a box: NVML index, name, memory, compute capability, PCI bus id, and its MIG state when MIG is on or
  pending. The GPUs sit in one frame per NUMA node (the CPU socket they hang off, with its CPUs), because crossing
  sockets (SYS) is the slowest path and the one that decides process pinning.
- Inside a NUMA node, GPUs that share a closer PCIe ancestor sit in a faint inner frame (one PCIe switch, one host
  bridge): the tree ``nvidia-smi topo -m`` encodes in its matrix, made visible.
- A line joins two GPUs. Its colour and label say the link (NV# NVLinks, else PIX, PXB, PHB, NODE, SYS); NVLink lines
  are thicker the more links are bonded; a dashed line means NVML reports no P2P for the pair (its reason is in the
  footer and in the line's tooltip). A line that would cross another GPU's box bends around it.
- Many pairs, one picture. Drawing every pair does not scale: 8 GPUs have 28 pairs, 28 labels on top of each other.
  Two rules keep the picture readable without hiding a pair:
  * when every pair between two neighbouring frames shares one link and P2P status (typically SYS between the two
    sockets: 16 pairs), one line joins the two frames, labelled with the count ("SYS ×16");
  * when three or more members share one path (every pair of an NVSwitch box is NV18; four cards on one host bridge
    are PHB), the path is drawn as a bar, a hub, with one spoke per member. That is also what the hardware is: an
    NVSwitch or a host bridge that every pair goes through. An 8-GPU NVSwitch machine (8x-h100-sxm) becomes two
    columns of four GPUs, one per socket, with the NVSwitch bar between them: 8 spokes instead of 28 crossing lines.
  A pair that fits neither rule (an NVLink, a pair whose P2P status differs from its neighbours') keeps its own line.
- A machine without a usable GPU gets a picture that says so and why (NVML's words), not an error: ``detect`` works on
  a CPU-only machine, so a script that collects every node's picture gets one from each.

Every link element carries ``data-pairs`` (``"0-1 2-3"``), ``data-link`` (the ``topo -m`` label) and ``data-p2p``
(``OK`` or NVML's reason), so tests and readers can check the picture against ``detect``'s matrix.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

from ..hardware.profile import TOPOLOGY_ORDER, GpuInfo, GpuPair, HardwareProfile
from ..hardware.topology import LEGEND, p2p_summary
from ..textfmt import gib

FONT = 'font-family="sans-serif"'
# One colour per link kind, the order of the legend: fastest first.
COLORS = {"NV": "#2ca02c", "PIX": "#1f77b4", "PXB": "#17becf", "PHB": "#ff7f0e", "NODE": "#9467bd",
          "SYS": "#d62728", "?": "#7f7f7f"}
P2P_DASH = "7 5"  # stroke-dasharray of a link without P2P
PCIE_WIDTH = 1.6
# The path a hub bar or an inner frame stands for, by its PCIe level.
PATH_NAMES = {"PIX": "PCIe switch", "PXB": "PCIe switches", "PHB": "host bridge", "NODE": "NUMA node",
              "SYS": "CPU interconnect", "?": "unknown path"}

GPU_H_LINE = 15  # px per text line in a GPU box
ROW_GAP = 90  # between boxes side by side: room for a label such as "SYS ×16"
COLUMN_GAP = 46  # between boxes stacked
PAD = 12  # inside a frame
CAPTION = 18  # a frame's caption line
HUB_GAP = 34  # between the members and their hub bar
HUB_THICK = 112  # a vertical hub bar's width, a horizontal one's height is HUB_BAND
HUB_BAND = 30
SOCKET_GAP = 120  # between NUMA nodes: the cross-socket line shows on both sides of its label
FABRIC_GAP = 230  # between the two columns of an all-NVLink machine: spoke, bar, spoke
MARGIN = 20


def link_kind(label: str) -> str:
    """"NV" for any NV#, else the PCIe level ("?" when unknown): the key of COLORS."""
    return "NV" if label.startswith("NV") else (label if label in COLORS else "?")


def stroke_width(label: str) -> float:
    """NVLink lines grow with the number of bonded links (NV1 3.4 px .. NV18 7.9 px); PCIe lines stay thin."""
    if link_kind(label) != "NV":
        return PCIE_WIDTH
    count = int(label[2:]) if label[2:].isdigit() else 1
    return round(2 + 1.4 * math.sqrt(count), 1)


def legend_words() -> dict[str, str]:
    """The words of ``detect``'s legend line, by label ("SYS" -> "crosses the NUMA interconnect"), so the picture and
    the text say the same thing."""
    words = {}
    for part in LEGEND.removeprefix("Legend:").split(","):
        key, _, meaning = part.strip().partition(" ")
        words["NV" if key == "NV#" else key] = meaning
    return words


# ------------------------------------------------------------------------------------------------------- the model

@dataclass(eq=False)
class _Node:
    """A GPU box (one member, no children) or a frame around members laid out in a row or a column."""

    gpus: tuple[int, ...]
    children: list[_Node] = field(default_factory=list)
    horizontal: bool = True  # children side by side, else stacked
    caption: str | None = None
    kind: str = "gpu"  # "gpu", "numa" (a NUMA node's frame), "pcie" (GPUs sharing a closer PCIe ancestor), "bare"
    gap: float | None = None  # between children; None: ROW_GAP or COLUMN_GAP
    slack: float = 0.0
    hub: _Link | None = None  # a bar for the pairs between the children
    x: float = 0.0
    y: float = 0.0
    w: float = 0.0
    h: float = 0.0

    @property
    def framed(self) -> bool:
        return self.kind in ("numa", "pcie")

    @property
    def cx(self) -> float:
        return self.x + self.w / 2

    @property
    def cy(self) -> float:
        return self.y + self.h / 2

    def walk(self):
        yield self
        for child in self.children:
            yield from child.walk()


@dataclass(eq=False)
class _Link:
    """One drawn link: a line between two GPUs ("line"), between two frames ("bundle"), or a hub bar ("hub")."""

    pairs: list[GpuPair]
    shape: str
    ends: tuple[_Node, ...]  # line/bundle: the two ends; hub: the members with a spoke
    path: str = ""  # line/bundle: the SVG path
    points: list[tuple[float, float]] = field(default_factory=list)  # line/bundle: samples along it, for labels
    bar: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # hub: x, y, w, h
    spokes: list[tuple[_Node, float, float, float, float]] = field(default_factory=list)  # member, x1, y1 (its edge), x2, y2
    name: str = ""  # hub: what the bar stands for
    columns: tuple[list[_Node], list[_Node]] | None = None  # the fabric hub: the GPU boxes left and right of the bar
    text_at: tuple[float, float] | None = None

    @property
    def label(self) -> str:
        return self.pairs[0].label

    @property
    def problem(self) -> str | None:
        return self.pairs[0].p2p_problem

    @property
    def text(self) -> str:
        return self.label if self.shape == "line" else f"{self.label} ×{len(self.pairs)}"


def _key(pair: GpuPair) -> tuple[str, str | None]:
    return pair.label, pair.p2p_problem


def _all_pairs(profile: HardwareProfile) -> dict[tuple[int, int], GpuPair]:
    """Every pair of GPUs, from ``profile.pairs``; a pair NVML did not report is drawn as "?" without P2P."""
    found = {}
    for a, b in combinations(sorted(g.index for g in profile.gpus), 2):
        found[(a, b)] = profile.pair(a, b) or GpuPair(a, b, topology=None)
    return found


def _rank(pair: GpuPair) -> int:
    return TOPOLOGY_ORDER.index(pair.topology) if pair.topology in TOPOLOGY_ORDER else len(TOPOLOGY_ORDER)


def _numa_groups(profile: HardwareProfile) -> list[tuple[str, tuple[int, ...]]]:
    """(caption, GPU indices) per NUMA node, in node order; GPUs whose node is unknown share one group."""
    groups: dict[object, list[GpuInfo]] = {}
    for gpu in profile.gpus:
        groups.setdefault(gpu.numa_node if gpu.numa_node is not None else "?", []).append(gpu)
    out = []
    for node, gpus in sorted(groups.items(), key=lambda item: (item[0] == "?", str(item[0]).zfill(4))):
        cpus = sorted({g.cpu_affinity for g in gpus if g.cpu_affinity})
        caption = f"NUMA node {node}" if node != "?" else "NUMA node not reported"
        if cpus:
            caption += f" · CPUs {', '.join(cpus)}"
        out.append((caption, tuple(g.index for g in gpus)))
    return out


def _pcie_tree(members: tuple[int, ...], pairs, boxes: dict[int, _Node]) -> list[_Node]:
    """The children of a frame: groups of GPUs joined by a closer PCIe ancestor than the frame's farthest pair
    (nvidia-smi's levels nest: two GPUs under one switch are PIX, the switches under one bridge PXB...)."""
    if len(members) == 1:
        return [boxes[members[0]]]
    ranks = {(a, b): _rank(pairs[(a, b)]) for a, b in combinations(members, 2)}
    top = max(ranks.values())
    parent = {m: m for m in members}

    def find(m: int) -> int:
        while parent[m] != m:
            m = parent[m]
        return m

    for (a, b), rank in ranks.items():
        if rank < top:
            parent[find(a)] = find(b)
    components: dict[int, list[int]] = {}
    for m in members:
        components.setdefault(find(m), []).append(m)
    parts = sorted(components.values(), key=min)
    if len(parts) == 1:  # the levels do not nest (a snapshot edited by hand): no inner frames
        parts = [[m] for m in members]
    children = []
    for part in parts:
        if len(part) == 1:
            children.append(boxes[part[0]])
            continue
        inner = max(_rank(pairs[(a, b)]) for a, b in combinations(part, 2))
        level = TOPOLOGY_ORDER[inner] if inner < len(TOPOLOGY_ORDER) else "?"
        inner_children = _pcie_tree(tuple(part), pairs, boxes)
        children.append(_Node(tuple(part), inner_children, _side_by_side(inner_children),
                              f"{level}: {PATH_NAMES.get(level, level)}", "pcie"))
    return children


def _side_by_side(children: list[_Node]) -> bool:
    """A frame stacks its children in one column (up to four GPUs tall: the picture fits a page's width), unless
    it holds more than four GPUs grouped in inner frames: those frames then stand side by side, each a column."""
    return sum(len(c.gpus) for c in children) > 4 and any(c.children for c in children)


# ---------------------------------------------------------------------------------------------------- the links

def _plan_links(node: _Node, pairs, boxes: dict[int, _Node], links: list[_Link]) -> None:
    """Decide, frame by frame, which pairs between the frame's children get a hub, a bundle or their own line."""
    for child in node.children:
        _plan_links(child, pairs, boxes, links)
    children = node.children
    if len(children) < 2:
        return
    side = {g: i for i, c in enumerate(children) for g in c.gpus}  # which child holds each GPU
    between = sorted((p for (a, b), p in pairs.items() if a in side and b in side and side[a] != side[b]),
                     key=lambda p: (p.a, p.b))
    links += [_Link([p], "line", (boxes[p.a], boxes[p.b])) for p in between if p.nvlinks]
    pcie = [p for p in between if not p.nvlinks]
    members = sorted({side[g] for p in pcie for g in (p.a, p.b)})
    if len(members) >= 3 and len({_key(p) for p in pcie}) == 1:
        node.hub = _Link(pcie, "hub", tuple(children[i] for i in members))
        links.append(node.hub)
        return
    for i, j in combinations(range(len(children)), 2):
        here = [p for p in pcie if {side[p.a], side[p.b]} == {i, j}]
        if not here:
            continue
        if j == i + 1 and (len(children[i].gpus) > 1 or len(children[j].gpus) > 1):
            by_key: dict[tuple, list[GpuPair]] = {}
            for p in here:
                by_key.setdefault(_key(p), []).append(p)
            main = max(by_key.values(), key=len)
            links.append(_Link(main, "bundle", (children[i], children[j])))
            here = [p for p in here if p not in main]
        links += [_Link([p], "line", (boxes[p.a], boxes[p.b])) for p in here]


# --------------------------------------------------------------------------------------------------- the layout

def _measure(node: _Node, box_w: float, box_h: float) -> None:
    if not node.children:
        node.w, node.h = box_w, box_h
        return
    for child in node.children:
        _measure(child, box_w, box_h)
    gap = node.gap if node.gap is not None else (ROW_GAP if node.horizontal else COLUMN_GAP)
    sizes = [(c.w, c.h) for c in node.children]
    if node.horizontal:
        content_w, content_h = sum(w for w, _ in sizes) + gap * (len(sizes) - 1), max(h for _, h in sizes)
    else:
        content_w, content_h = max(w for w, _ in sizes), sum(h for _, h in sizes) + gap * (len(sizes) - 1)
    if node.hub is not None and not node.hub.columns:  # a fabric's bar lives in the gap between its columns
        if node.horizontal:
            content_h += HUB_GAP + HUB_BAND
        else:
            content_w += HUB_GAP + HUB_THICK
    pad = PAD if node.framed else 0
    caption_w = _text_w(node.caption, 11 if node.kind == "numa" else 9) if node.caption else 0.0
    node.w = max(content_w, caption_w) + 2 * pad
    node.slack = max(0.0, caption_w - content_w)  # a caption wider than the content: centre the content under it
    node.h = content_h + 2 * pad + (CAPTION if node.caption else 0)


def _place(node: _Node, x: float, y: float) -> None:
    node.x, node.y = x, y
    if not node.children:
        return
    pad = PAD if node.framed else 0
    left, top = x + pad + node.slack / 2, y + pad + (CAPTION if node.caption else 0)
    gap = node.gap if node.gap is not None else (ROW_GAP if node.horizontal else COLUMN_GAP)
    along_row = max(c.h for c in node.children)
    along_column = max(c.w for c in node.children)
    for child in node.children:
        if node.horizontal:
            _place(child, left, top + (along_row - child.h) / 2)
            left += child.w + gap
        else:
            _place(child, left + (along_column - child.w) / 2, top)
            top += child.h + gap


def _hub_geometry(node: _Node) -> None:
    hub = node.hub
    members = hub.ends
    if node.horizontal:
        y = max(c.y + c.h for c in node.children) + HUB_GAP
        x0, x1 = min(c.x for c in members), max(c.x + c.w for c in members)
        hub.bar = (x0, y, x1 - x0, HUB_BAND)
        hub.spokes = [(c, c.cx, c.y + c.h, c.cx, y) for c in members]
    else:
        x = max(c.x + c.w for c in node.children) + HUB_GAP
        y0, y1 = min(c.y for c in members), max(c.y + c.h for c in members)
        hub.bar = (x, y0, HUB_THICK, y1 - y0)
        hub.spokes = [(c, c.x + c.w, c.cy, x, c.cy) for c in members]


def _bundle_geometry(link: _Link, parent_horizontal: bool) -> None:
    c1, c2 = link.ends
    if parent_horizontal:
        y = (max(c1.y, c2.y) + min(c1.y + c1.h, c2.y + c2.h)) / 2
        (x1, x2) = (c1.x + c1.w, c2.x)
        link.points = [(x1 + (x2 - x1) * t / 20, y) for t in range(21)]
    else:
        x = (max(c1.x, c2.x) + min(c1.x + c1.w, c2.x + c2.w)) / 2
        (y1, y2) = (c1.y + c1.h, c2.y)
        link.points = [(x, y1 + (y2 - y1) * t / 20) for t in range(21)]
    (xa, ya), (xb, yb) = link.points[0], link.points[-1]
    link.path = f"M{xa:.1f},{ya:.1f} L{xb:.1f},{yb:.1f}"


def _inside(x: float, y: float, rect: tuple[float, float, float, float], margin: float = 0.0) -> bool:
    rx, ry, rw, rh = rect
    return rx - margin <= x <= rx + rw + margin and ry - margin <= y <= ry + rh + margin


def _route(link: _Link, obstacles: list[tuple[_Node | None, tuple]], centre: tuple[float, float],
           drawn: list[tuple[float, float]]) -> None:
    """A straight line between the two GPU boxes' centres or, when that crosses another GPU's box or a hub bar, the
    flattest quadratic curve that does not and keeps clear of the lines already drawn (``drawn``: their sample points),
    bowing away from the middle of the picture first."""
    a, b = link.ends
    (x0, y0), (x2, y2) = (a.cx, a.cy), (b.cx, b.cy)
    length = math.hypot(x2 - x0, y2 - y0) or 1.0
    nx, ny = -(y2 - y0) / length, (x2 - x0) / length
    mx, my = (x0 + x2) / 2, (y0 + y2) / 2
    outward = 1.0 if (mx - centre[0]) * nx + (my - centre[1]) * ny >= 0 else -1.0
    blockers = [rect for owner, rect in obstacles if owner is not a and owner is not b]
    ends = [(a.x, a.y, a.w, a.h), (b.x, b.y, b.w, b.h)]
    best = None
    bows = sorted(((step, sign) for step in range(1, 16) for sign in (outward, -outward)),
                  key=lambda c: c[0] + (0 if c[1] == outward else 2.5))  # outward first, inward when much flatter
    for bow in [0.0] + [sign * step * 28.0 for step, sign in bows]:
        cx, cy = mx + 2 * bow * nx, my + 2 * bow * ny
        points = [((1 - t) ** 2 * x0 + 2 * t * (1 - t) * cx + t * t * x2, (1 - t) ** 2 * y0 + 2 * t * (1 - t) * cy + t * t * y2)
                  for t in (i / 40 for i in range(41))]
        if any(_inside(px, py, rect, 6) for px, py in points for rect in blockers):
            continue
        crowding = sum(1 for px, py in points if not any(_inside(px, py, r, 6) for r in ends)
                       and any(abs(px - qx) < 7 and abs(py - qy) < 7 for qx, qy in drawn))
        if best is None or crowding < best[0]:
            best = (crowding, bow, cx, cy, points)
        if crowding <= 3:  # crossing a line touches a few samples; running along one touches many
            break
    if best is None:  # boxed in on every side (cannot happen with the layouts above): the straight line
        best = (0, 0.0, mx, my, [(x0 + (x2 - x0) * i / 40, y0 + (y2 - y0) * i / 40) for i in range(41)])
    _, bow, cx, cy, link.points = best
    drawn.extend(link.points)
    link.path = (f"M{x0:.1f},{y0:.1f} L{x2:.1f},{y2:.1f}" if bow == 0 else
                 f"M{x0:.1f},{y0:.1f} Q{cx:.1f},{cy:.1f} {x2:.1f},{y2:.1f}")


def _distance(a: _Node, b: _Node) -> float:
    return math.hypot(a.cx - b.cx, a.cy - b.cy)


def _text_w(text: str, size: float) -> float:
    return len(text) * size * 0.6


def _label_rect(text: str, x: float, y: float) -> tuple[float, float, float, float]:
    w = _text_w(text, 10) + 8
    return (x - w / 2, y - 8, w, 15)


def _overlaps(r1, r2) -> bool:
    return r1[0] < r2[0] + r2[2] and r2[0] < r1[0] + r1[2] and r1[1] < r2[1] + r2[3] and r2[1] < r1[1] + r1[3]


def _place_labels(links: list[_Link], boxes: list[tuple]) -> None:
    """Each line's label on the line, at the first spot (middle first) that covers no GPU box and no other label."""
    taken: list[tuple] = []
    for link in sorted(links, key=lambda lk: lk.shape != "bundle"):
        if link.shape == "hub":
            continue
        count = len(link.points) - 1
        spots = [0.5, 0.4, 0.6, 0.3, 0.7, 0.35, 0.65, 0.25, 0.75, 0.45, 0.55]
        choice = None
        for t in spots:
            x, y = link.points[round(t * count)]
            rect = _label_rect(link.text, x, y)
            if not any(_overlaps(rect, r) for r in taken + boxes):
                choice = (x, y, rect)
                break
        if choice is None:
            x, y = link.points[count // 2]
            choice = (x, y, _label_rect(link.text, x, y))
        link.text_at = choice[:2]
        taken.append(choice[2])


# ------------------------------------------------------------------------------------------------------ drawing

def _gpu_lines(gpu: GpuInfo) -> list[tuple[str, int, str, str]]:
    """(text, size, weight, colour) lines of a GPU box."""
    lines = [(f"GPU{gpu.index}", 13, "bold", "black"), (gpu.name, 11, "normal", "black"),
             (f"{gib(gpu.memory_total_bytes)} · CC {gpu.capability_str}", 11, "normal", "black"),
             (f"bus {gpu.pci_bus_id}", 9, "normal", "#555555")]
    if gpu.mig_change_pending:
        lines.append((f"MIG {'on' if gpu.mig_enabled else 'off'} → {'on' if gpu.mig_pending_enabled else 'off'}"
                      " at the next GPU reset", 10, "normal", "#8e44ad"))
    elif gpu.mig_enabled:
        instances = gpu.mig_instances or ()
        profiles: dict[str, int] = {}
        for m in instances:
            profiles[m.profile] = profiles.get(m.profile, 0) + 1
        what = ", ".join(f"{p} ×{n}" if n > 1 else p for p, n in profiles.items()) or "no instance: CUDA sees no device"
        lines.append((f"MIG on: {what}", 10, "normal", "#8e44ad"))
    return lines


def _attr(name: str, value: object) -> str:
    return f" {name}={quoteattr(str(value))}"


def _stroke(label: str, problem: str | None) -> str:
    dash = f' stroke-dasharray="{P2P_DASH}"' if problem else ""
    return f' stroke="{COLORS[link_kind(label)]}" stroke-width="{stroke_width(label)}"{dash} fill="none"'


def _pairs_text(pairs: list[GpuPair]) -> str:
    return " ".join(f"{p.a}-{p.b}" for p in pairs)


def _tooltip(link: _Link) -> str:
    words = legend_words().get(link_kind(link.label), "")
    head = f"{link.label} ({words})" if words else link.label
    p2p = "P2P OK" if link.problem is None else f"no P2P: {link.problem}"
    pairs = ", ".join(f"GPU{p.a}-GPU{p.b}" for p in link.pairs)
    return f"{head}, {p2p}: {pairs}"


def _link_svg(link: _Link, ox: float, oy: float) -> list[str]:
    attrs = (_attr("class", f"link {link.shape}") + _attr("data-pairs", _pairs_text(link.pairs))
             + _attr("data-link", link.label) + _attr("data-p2p", link.problem or "OK"))
    out = [f"<g{attrs}>", f"<title>{escape(_tooltip(link))}</title>"]
    if link.shape != "hub":
        path = _shift_path(link.path, ox, oy)
        out.append(f'<path d="{path}"{_stroke(link.label, link.problem)}/>')
    else:
        for node, x1, y1, x2, y2 in link.spokes:
            out.append(f'<line class="spoke"{_attr("data-gpus", " ".join(map(str, node.gpus)))} x1="{x1 + ox:.1f}" '
                       f'y1="{y1 + oy:.1f}" x2="{x2 + ox:.1f}" y2="{y2 + oy:.1f}"{_stroke(link.label, link.problem)}/>')
        x, y, w, h = link.bar
        color = COLORS[link_kind(link.label)]
        dash = f' stroke-dasharray="{P2P_DASH}"' if link.problem else ""
        out.append(f'<rect class="hub-bar" x="{x + ox:.1f}" y="{y + oy:.1f}" width="{w:.1f}" height="{h:.1f}" rx="6" '
                   f'fill="#f7f7f7" stroke="{color}" stroke-width="2"{dash}/>')
        words = [link.name, f"{link.label} between", f"every pair ({len(link.pairs)})"]
        if link.problem:
            words.append("no P2P")
        if w > h:  # a horizontal band: one line
            words = [" · ".join([link.name, f"{link.label} between every pair ({len(link.pairs)})"]
                                + (["no P2P"] if link.problem else []))]
        top = y + oy + h / 2 - (len(words) - 1) * 7
        for i, word in enumerate(words):
            weight = "bold" if i == 0 else "normal"
            out.append(f'<text x="{x + ox + w / 2:.1f}" y="{top + 14 * i + 4:.1f}" text-anchor="middle" font-size="11" '
                       f'font-weight="{weight}" fill="{color if i else "black"}" {FONT}>{escape(word)}</text>')
    out.append("</g>")
    return out


def _shift_path(path: str, ox: float, oy: float) -> str:
    out = []
    for token in path.split():
        cmd = token[0] if token[0].isalpha() else ""
        x, y = map(float, token[len(cmd):].split(","))
        out.append(f"{cmd}{x + ox:.1f},{y + oy:.1f}")
    return " ".join(out)


def _label_svg(link: _Link, ox: float, oy: float) -> list[str]:
    x, y = link.text_at
    rx, ry, rw, rh = _label_rect(link.text, x + ox, y + oy)
    color = COLORS[link_kind(link.label)]
    return [f'<g class="link-label"{_attr("data-pairs", _pairs_text(link.pairs))}>',
            f'<rect x="{rx:.1f}" y="{ry:.1f}" width="{rw:.1f}" height="{rh:.1f}" rx="3" fill="white" fill-opacity="0.9"/>',
            f'<text x="{x + ox:.1f}" y="{y + oy + 3.5:.1f}" text-anchor="middle" font-size="10" font-weight="bold" '
            f'fill="{color}" {FONT}>{escape(link.text)}</text>', "</g>"]


def _frame_svg(node: _Node, ox: float, oy: float) -> list[str]:
    numa = node.kind == "numa"
    style = ('fill="#f3f6fa" stroke="#8a9bb0" stroke-width="1.2"' if numa else
             'fill="none" stroke="#b0b0b0" stroke-width="1" stroke-dasharray="2 3"')
    out = [f'<g class="group {node.kind}"{_attr("data-gpus", " ".join(map(str, node.gpus)))}>',
           f'<rect x="{node.x + ox:.1f}" y="{node.y + oy:.1f}" width="{node.w:.1f}" height="{node.h:.1f}" rx="8" {style}/>']
    if node.caption:
        size = 11 if numa else 9
        out.append(f'<text x="{node.x + ox + PAD:.1f}" y="{node.y + oy + PAD + 9:.1f}" font-size="{size}" '
                   f'fill="{"#333333" if numa else "#777777"}" {FONT}>{escape(node.caption)}</text>')
    out.append("</g>")
    return out


def _gpu_svg(node: _Node, gpu: GpuInfo, ox: float, oy: float) -> list[str]:
    x, y = node.x + ox, node.y + oy
    tooltip = f"GPU{gpu.index} {gpu.name}, {gpu.uuid}, bus {gpu.pci_bus_id}, NUMA node {gpu.numa_node}"
    out = [f'<g class="gpu"{_attr("data-gpu", gpu.index)}>', f"<title>{escape(tooltip)}</title>",
           f'<rect x="{x:.1f}" y="{y:.1f}" width="{node.w:.1f}" height="{node.h:.1f}" rx="6" fill="white" '
           f'stroke="#333333" stroke-width="1.5"/>']
    for i, (text, size, weight, color) in enumerate(_gpu_lines(gpu)):
        out.append(f'<text x="{x + 10:.1f}" y="{y + 20 + GPU_H_LINE * i:.1f}" font-size="{size}" font-weight="{weight}" '
                   f'fill="{color}" {FONT}>{escape(text)}</text>')
    out.append("</g>")
    return out


def _text_block(lines: list[str], x: float, y: float, size: int = 11, color: str = "#333333") -> list[str]:
    return [f'<text x="{x:.1f}" y="{y + (size + 4) * i:.1f}" font-size="{size}" fill="{color}" {FONT}>{escape(line)}</text>'
            for i, line in enumerate(lines)]


def _document(width: float, height: float, body: list[str]) -> str:
    head = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}">', f'<rect width="{width:.0f}" height="{height:.0f}" fill="white"/>']
    return "\n".join(head + body + ["</svg>"]) + "\n"


def _title(profile: HardwareProfile) -> tuple[str, str]:
    h = profile.host
    names: dict[str, int] = {}
    for g in profile.gpus:
        names[g.name] = names.get(g.name, 0) + 1
    gpus = " + ".join(f"{n}x {name}" for name, n in names.items()) or "no GPU"
    host = (f"{h.cpu_model or 'CPU ?'}, {h.numa_nodes or '?'} NUMA node(s)"
            + (f", driver {profile.driver_version}" if profile.driver_version else ""))
    return f"GPU topology: {profile.display_name} ({gpus})", host


def _no_gpu_picture(profile: HardwareProfile) -> str:
    title, host = _title(profile)
    reason = profile.nvml_error or "NVML works but reports no GPU on this machine."
    lines = textwrap.wrap(f"No GPU to draw: {reason}", 90)
    if profile.host.nvidia_pci_devices:
        lines += textwrap.wrap(f"{profile.host.nvidia_pci_devices} NVIDIA device(s) sit on the PCI bus: "
                               "hf-gpu-train doctor names the fix.", 90)
    width = max(640, 2 * MARGIN + max(_text_w(t, 11) for t in [title, host, *lines]))
    body = ['<g class="no-gpu">', *_text_block([title], MARGIN, 28, 15, "black"), *_text_block([host], MARGIN, 48, 11),
            *_text_block(lines, MARGIN, 80, 12, "#b03a2e"), "</g>"]
    return _document(width, 80 + 16 * len(lines) + MARGIN, body)


def render_topology_svg(profile: HardwareProfile) -> str:
    """The picture of ``profile``'s GPUs and the links between every pair, as SVG text (see the module docstring)."""
    if profile.nvml_error or not profile.gpus:
        return _no_gpu_picture(profile)
    gpus = {g.index: g for g in profile.gpus}
    pairs = _all_pairs(profile)
    boxes = {i: _Node((i,)) for i in gpus}
    keys = {_key(p) for p in pairs.values()}
    if len(gpus) >= 3 and len(keys) == 1 and link_kind(next(iter(keys))[0]) == "NV":
        root, links = _fabric(profile, pairs, boxes)
    else:
        frames = []
        for caption, members in _numa_groups(profile):
            children = _pcie_tree(members, pairs, boxes)
            frames.append(_Node(members, children, _side_by_side(children), caption, "numa"))
        root, links = _Node(tuple(gpus), frames, True, kind="bare", gap=SOCKET_GAP), []
        _plan_links(root, pairs, boxes, links)

    text_w = max(_text_w(text, size) for g in profile.gpus for text, size, *_ in _gpu_lines(g))
    _measure(root, max(150.0, text_w + 20), 12 + GPU_H_LINE * max(len(_gpu_lines(g)) for g in profile.gpus))
    _place(root, 0.0, 0.0)
    _draw_links(root, links, boxes)

    # Everything was laid out from (0, 0); curves may bow above or left of it: shift it all below the title.
    xs = [root.x, root.x + root.w] + [x for lk in links for x, _ in lk.points]
    ys = [root.y, root.y + root.h] + [y for lk in links for _, y in lk.points]
    ox, oy = MARGIN - min(xs), 62 - min(ys)
    title, host = _title(profile)
    legend, notes, height = _legend(profile, links, max(ys) + oy + 28)
    width = max(max(xs) + ox + MARGIN, 2 * MARGIN + max(_text_w(t, 11) for t in [host, *notes]),
                2 * MARGIN + _text_w(title, 15))

    body = [*_text_block([title], MARGIN, 26, 15, "black"), *_text_block([host], MARGIN, 44, 11)]
    for node in root.walk():
        if node.framed:
            body += _frame_svg(node, ox, oy)
    for link in links:
        body += _link_svg(link, ox, oy)
    for index, node in boxes.items():
        body += _gpu_svg(node, gpus[index], ox, oy)
    for link in links:
        if link.shape != "hub":
            body += _label_svg(link, ox, oy)
    return _document(width, height, body + legend)


def _fabric(profile: HardwareProfile, pairs, boxes: dict[int, _Node]) -> tuple[_Node, list[_Link]]:
    """Every pair the same NVLink (an NVSwitch machine): two columns of GPUs, one per socket where the machine has
    two, around one hub bar; its geometry waits for the layout (``_draw_links``)."""
    groups = _numa_groups(profile)
    if len(groups) >= 2:
        half = (len(groups) + 1) // 2
        frames = [_Node(members, [boxes[i] for i in members], False, caption, "numa") for caption, members in groups]
        columns = [_Node(tuple(i for f in part for i in f.gpus), part, False, kind="bare")
                   for part in (frames[:half], frames[half:])]
        root = _Node(tuple(boxes), columns, True, kind="bare", gap=FABRIC_GAP)
    else:
        order = groups[0][1]
        half = (len(order) + 1) // 2
        columns = [_Node(part, [boxes[i] for i in part], False, kind="bare") for part in (order[:half], order[half:])]
        root = _Node(order, [_Node(order, columns, True, groups[0][0], "numa", gap=FABRIC_GAP)], True, kind="bare")
    hub = _Link(sorted(pairs.values(), key=lambda p: (p.a, p.b)), "hub", tuple(boxes[i] for i in sorted(boxes)),
                name="NVSwitch" if all(g.nvswitch_links for g in profile.gpus) else "NVLink",
                columns=tuple([boxes[i] for i in column.gpus] for column in columns))
    root.hub = hub
    return root, [hub]


def _draw_links(root: _Node, links: list[_Link], boxes: dict[int, _Node]) -> None:
    """The geometry of every link, once the boxes are placed: hub bars and their spokes, bundles, then the lines
    (shortest first, so the long ones bend around what is already there), then the labels."""
    for node in root.walk():
        if node.hub is None:
            continue
        if node.hub.columns:  # the fabric bar, between the two columns
            left, right = node.hub.columns
            bar_x = (max(b.x + b.w for b in left) + min(b.x for b in right) - HUB_THICK) / 2
            ys = [b.cy for b in left + right]
            node.hub.bar = (bar_x, min(ys) - 24, HUB_THICK, max(ys) - min(ys) + 48)
            node.hub.spokes = ([(b, b.x + b.w, b.cy, bar_x, b.cy) for b in left]
                               + [(b, b.x, b.cy, bar_x + HUB_THICK, b.cy) for b in right])
        else:
            _hub_geometry(node)
            node.hub.name = PATH_NAMES.get(link_kind(node.hub.label), "shared path")
    parents = {id(c): n for n in root.walk() for c in n.children}
    for link in links:
        if link.shape == "bundle":
            _bundle_geometry(link, parents[id(link.ends[0])].horizontal)
    obstacles = [(b, (b.x, b.y, b.w, b.h)) for b in boxes.values()] + [(None, lk.bar) for lk in links if lk.shape == "hub"]
    drawn = [point for link in links for point in link.points]
    for link in sorted((lk for lk in links if lk.shape == "line"), key=lambda lk: _distance(*lk.ends)):
        _route(link, obstacles, (root.cx, root.cy), drawn)
    _place_labels(links, [_label_margin(rect) for _, rect in obstacles])


def _legend(profile: HardwareProfile, links: list[_Link], top: float) -> tuple[list[str], list[str], float]:
    """(SVG lines, the notes' text, the picture's height): a sample line per link kind drawn, the dashed line, then
    detect's P2P line and what a bundle or a bar stands for."""
    words = legend_words()
    kinds = [k for k in COLORS if any(link_kind(lk.label) == k for lk in links)]
    out = ['<g class="legend">']
    y = top
    for kind in kinds:
        meaning = "NVLink, NV# bonded links (thicker: more links)" if kind == "NV" else f"{kind}: {words.get(kind, 'unknown path')}"
        out.append(f'<line x1="{MARGIN}" y1="{y:.1f}" x2="{MARGIN + 40}" y2="{y:.1f}"{_stroke("NV4" if kind == "NV" else kind, None)}/>')
        out += _text_block([meaning], MARGIN + 50, y + 4, 11)
        y += 18
    if any(lk.problem for lk in links):
        out.append(f'<line x1="{MARGIN}" y1="{y:.1f}" x2="{MARGIN + 40}" y2="{y:.1f}"{_stroke("?", "no")}/>')
        out += _text_block(["dashed: NVML reports no P2P for the pair (reason below)"], MARGIN + 50, y + 4, 11)
        y += 18
    notes = []
    if len(profile.gpus) > 1:
        notes += textwrap.wrap(p2p_summary(profile), 110)
        notes.append("NV# wins over the PCIe path, as in nvidia-smi topo -m.")
        bundle = max((lk for lk in links if lk.shape == "bundle"), key=lambda lk: len(lk.pairs), default=None)
        if bundle is not None:
            notes.append(f"A line between two frames stands for every pair across them: \"{bundle.text}\" is "
                         f"{len(bundle.pairs)} pairs alike.")
        if any(lk.shape == "hub" for lk in links):
            notes.append("A bar is a path that every pair of its members shares; each member has one spoke.")
    else:
        notes.append("One GPU: no link to draw.")
    out += _text_block(notes, MARGIN, y + 12, 11)
    out.append("</g>")
    return out, notes, y + 12 + 15 * len(notes) + MARGIN


def _label_margin(rect: tuple[float, float, float, float]) -> tuple[float, float, float, float]:
    x, y, w, h = rect
    return (x - 2, y - 2, w + 4, h + 4)


def save_topology_svg(profile: HardwareProfile, path: str | Path) -> Path:
    """Write the picture to ``path`` (its folder must exist) and return the path."""
    target = Path(path)
    target.write_text(render_topology_svg(profile), encoding="utf-8")
    return target
