"""`hf-gpu-train detect --topology-svg`: the picture says what detect's topology matrix says, pair by pair.

Each check reads the SVG as a reader's browser would (boxes, lines and where they start and end, colours, dashes,
labels) and compares it with `topology_matrix`, the table detect prints, and with NVML's P2P status of each pair.
"""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import replace
from itertools import combinations
from pathlib import Path

import pytest

from hf_gpu_train.cli import main
from hf_gpu_train.hardware.snapshot import load_machine, reference_machine_names
from hf_gpu_train.hardware.topology import p2p_summary, topology_matrix
from hf_gpu_train.report.topology_picture import COLORS, P2P_DASH, render_topology_svg
from tests.hardware.odd_machines import odd_machine, odd_machine_names

NS = "{http://www.w3.org/2000/svg}"
MACHINES = [(name, load_machine) for name in reference_machine_names()] + [(name, odd_machine) for name in odd_machine_names()]
WITH_GPUS = [(name, load) for name, load in MACHINES if load(name).gpus]


def detect_labels(profile) -> dict[tuple[int, int], str]:
    """The cell detect prints for each pair (its `nvidia-smi topo -m` matrix)."""
    rows = topology_matrix(profile)
    index = [int(cell.removeprefix("GPU")) for cell in rows[0][1:len(profile.gpus) + 1]]
    return {(a, b): rows[1 + index.index(a)][1 + index.index(b)] for a, b in combinations(sorted(index), 2)}


def rect_of(element) -> tuple[float, float, float, float]:
    rect = element.find(f"{NS}rect")
    return tuple(float(rect.get(k)) for k in ("x", "y", "width", "height"))


def inside(point, rect, tolerance: float = 0.6) -> bool:
    (x, y), (rx, ry, rw, rh) = point, rect
    return rx - tolerance <= x <= rx + rw + tolerance and ry - tolerance <= y <= ry + rh + tolerance


def curve(d: str, samples: int = 60) -> list[tuple[float, float]]:
    """The points along an SVG path "Mx,y Lx,y" or "Mx,y Qcx,cy x,y"."""
    tokens = d.split()
    start = tuple(map(float, tokens[0][1:].split(",")))
    if tokens[1].startswith("L"):
        end = tuple(map(float, tokens[1][1:].split(",")))
        control = ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2)
    else:
        control, end = tuple(map(float, tokens[1][1:].split(","))), tuple(map(float, tokens[2].split(",")))
    return [tuple((1 - t) ** 2 * s + 2 * t * (1 - t) * c + t * t * e for s, c, e in zip(start, control, end))
            for t in (i / samples for i in range(samples + 1))]


class Picture:
    def __init__(self, profile):
        self.svg = render_topology_svg(profile)
        self.root = ET.fromstring(self.svg)
        groups = list(self.root.iter(f"{NS}g"))
        self.boxes = {int(g.get("data-gpu")): rect_of(g) for g in groups if g.get("class") == "gpu"}
        self.box_text = {int(g.get("data-gpu")): " ".join(t.text for t in g.iter(f"{NS}text"))
                         for g in groups if g.get("class") == "gpu"}
        self.frames = [(set(map(int, g.get("data-gpus").split())), rect_of(g), g) for g in groups
                       if (g.get("class") or "").startswith("group ")]
        self.links = [g for g in groups if (g.get("class") or "").startswith("link ")]
        self.labels = [g for g in groups if g.get("class") == "link-label"]
        self.text = " ".join(t.text or "" for t in self.root.iter(f"{NS}text"))

    def shape_of(self, link) -> str:
        return link.get("class").split()[1]

    def strokes(self, link):
        return [e for e in link if e.tag in (f"{NS}path", f"{NS}line")]

    def region(self, gpus: set[int]) -> list[tuple]:
        """The rectangles that stand for exactly these GPUs: a GPU's box, or a frame around them."""
        found = [self.boxes[g] for g in gpus if len(gpus) == 1]
        return found + [rect for members, rect, _ in self.frames if members == gpus]


def pairs_of(link) -> list[tuple[int, int]]:
    return [tuple(map(int, p.split("-"))) for p in link.get("data-pairs").split()]


@pytest.mark.parametrize("name, load", WITH_GPUS, ids=[n for n, _ in WITH_GPUS])
def test_every_gpu_has_one_box_and_every_pair_one_link_as_detect_reports_it(name, load):
    profile = load(name)
    picture = Picture(profile)
    assert sorted(picture.boxes) == sorted(g.index for g in profile.gpus)
    for gpu in profile.gpus:
        assert f"GPU{gpu.index}" in picture.box_text[gpu.index] and gpu.name in picture.box_text[gpu.index]
    expected = detect_labels(profile)
    drawn = [pair for link in picture.links for pair in pairs_of(link)]
    assert sorted(drawn) == sorted(expected)  # each pair exactly once
    for link in picture.links:
        for a, b in pairs_of(link):
            pair = profile.pair(a, b)
            assert link.get("data-link") == expected[(a, b)], f"{name}: {a}-{b}"
            assert link.get("data-p2p") == ("OK" if pair.p2p_ok else pair.p2p_problem)
        label = link.get("data-link")
        colour = COLORS["NV" if label.startswith("NV") else label]
        for stroke in picture.strokes(link):
            assert stroke.get("stroke") == colour
            assert (stroke.get("stroke-dasharray") == P2P_DASH) == (link.get("data-p2p") != "OK")


@pytest.mark.parametrize("name, load", WITH_GPUS, ids=[n for n, _ in WITH_GPUS])
def test_each_link_starts_and_ends_at_what_it_joins_and_crosses_no_other_gpu(name, load):
    picture = Picture(load(name))
    for link in picture.links:
        pairs = pairs_of(link)
        if picture.shape_of(link) == "hub":
            bar = tuple(float(link.find(f"{NS}rect").get(k)) for k in ("x", "y", "width", "height"))
            spoked: set[int] = set()
            for spoke in picture.strokes(link):
                members = set(map(int, spoke.get("data-gpus").split()))
                ends = [(float(spoke.get("x1")), float(spoke.get("y1"))), (float(spoke.get("x2")), float(spoke.get("y2")))]
                assert any(inside(ends[0], r) for r in picture.region(members)) and inside(ends[1], bar)
                spoked |= members
            assert {g for pair in pairs for g in pair} <= spoked
            continue
        (path,) = picture.strokes(link)
        points = curve(path.get("d"))
        side_a, side_b = {a for a, _ in pairs}, {b for _, b in pairs}
        if picture.shape_of(link) == "bundle":  # from the frame (or box) holding one side to the one holding the other
            regions = [(members, rect) for members, rect, _ in picture.frames] + [({g}, r) for g, r in picture.boxes.items()]
            touched = [[m for m, r in regions if inside(end, r)] for end in (points[0], points[-1])]
            holders = [(ma, mb) for ma in touched[0] for mb in touched[1] if not ma & mb
                       and ((side_a <= ma and side_b <= mb) or (side_a <= mb and side_b <= ma))]
            assert holders, f"{name}: bundle {link.get('data-pairs')} does not join the frames of its GPUs"
            ma, mb = min(holders, key=lambda h: len(h[0]) + len(h[1]))
            # every pair across the two frames is in the bundle, or alike none of it and drawn on its own line
            singles = {pairs_of(other)[0]: other for other in picture.links if picture.shape_of(other) == "line"}
            for pair in (tuple(sorted((a, b))) for a in ma for b in mb):
                if pair not in pairs:
                    other = singles[pair]
                    assert (other.get("data-link"), other.get("data-p2p")) != (link.get("data-link"), link.get("data-p2p"))
        else:
            ((a, b),) = pairs
            assert inside(points[0], picture.boxes[a]) and inside(points[-1], picture.boxes[b])
            others = [rect for g, rect in picture.boxes.items() if g not in (a, b)]
            assert not [p for p in points for r in others if inside(p, r, tolerance=-1)], f"{a}-{b} crosses a GPU box"


@pytest.mark.parametrize("name, load", WITH_GPUS, ids=[n for n, _ in WITH_GPUS])
def test_labels_are_readable_and_gpus_sit_in_their_numa_node(name, load):
    profile = load(name)
    picture = Picture(profile)
    rects = [rect_of(label) for label in picture.labels]
    for r1, r2 in combinations(rects, 2):
        overlap = r1[0] < r2[0] + r2[2] and r2[0] < r1[0] + r1[2] and r1[1] < r2[1] + r2[3] and r2[1] < r1[1] + r1[3]
        assert not overlap, f"{name}: two link labels overlap"
    lines = [link for link in picture.links if picture.shape_of(link) != "hub"]
    assert sorted(label.get("data-pairs") for label in picture.labels) == sorted(link.get("data-pairs") for link in lines)
    for gpu in profile.gpus:
        (frame,) = [g for members, _, g in picture.frames if g.get("class") == "group numa" and gpu.index in members]
        node = "not reported" if gpu.numa_node is None else gpu.numa_node
        assert frame.find(f"{NS}text").text.startswith(f"NUMA node {node}")
        box = picture.boxes[gpu.index]
        assert inside((box[0], box[1]), rect_of(frame)) and inside((box[0] + box[2], box[1] + box[3]), rect_of(frame))
    if len(profile.gpus) > 1:
        assert p2p_summary(profile) in picture.text  # detect's P2P line, word for word


def test_nvlink_pairs_on_a_host_bridge_are_the_only_nvlink_lines_and_the_rest_is_dashed():
    picture = Picture(load_machine("4x-rtx3090-nvlink-pairs"))
    nvlink = {pair for link in picture.links for pair in pairs_of(link)
              if all(s.get("stroke") == COLORS["NV"] for s in picture.strokes(link))}
    dashed = {pair for link in picture.links for pair in pairs_of(link)
              if all(s.get("stroke-dasharray") for s in picture.strokes(link))}
    assert nvlink == {(0, 1), (2, 3)}
    assert dashed == {(0, 2), (0, 3), (1, 2), (1, 3)}
    widths = {link.get("data-link"): float(picture.strokes(link)[0].get("stroke-width")) for link in picture.links}
    assert widths["NV4"] > widths["PHB"]
    assert "host bridge" in picture.text  # the four cards' shared path is one bar with a spoke each


def test_an_nvswitch_machine_is_one_hub_not_28_crossing_labels():
    profile = load_machine("8x-h100-sxm")
    picture = Picture(profile)
    (hub,) = picture.links
    assert picture.shape_of(hub) == "hub" and len(pairs_of(hub)) == 28 and hub.get("data-link") == "NV18"
    assert len(picture.strokes(hub)) == 8 and picture.labels == []
    assert "NVSwitch" in picture.text
    numa = sorted(sorted(members) for members, _, g in picture.frames if g.get("class") == "group numa")
    assert numa == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # a spoke per GPU, none crossing another GPU's box
    for spoke in picture.strokes(hub):
        (gpu,) = map(int, spoke.get("data-gpus").split())
        x1, y, x2 = float(spoke.get("x1")), float(spoke.get("y1")), float(spoke.get("x2"))
        assert float(spoke.get("y2")) == y  # straight across, from the GPU's edge to the bar
        on_the_way = [g for g, r in picture.boxes.items()
                      if r[1] < y < r[1] + r[3] and min(x1, x2) - 1 <= r[0] + r[2] and r[0] <= max(x1, x2) + 1]
        assert on_the_way == [gpu]


def test_pcie_switches_across_two_sockets_draw_the_cross_socket_pairs_as_one_dashed_line():
    picture = Picture(load_machine("8x-a100-pcie-switches"))
    by_label: dict[str, list] = {}
    for link in picture.links:
        by_label.setdefault(link.get("data-link"), []).append(link)
    (sys_link,) = by_label["SYS"]
    assert picture.shape_of(sys_link) == "bundle" and len(pairs_of(sys_link)) == 16
    assert sys_link.get("data-p2p") == "IOH topology not supported"
    assert picture.strokes(sys_link)[0].get("stroke-dasharray") == P2P_DASH
    assert sorted(pairs_of(link)[0] for link in by_label["PIX"]) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert sorted(len(pairs_of(link)) for link in by_label["PXB"]) == [4, 4]
    assert len(picture.links) == 7  # 28 pairs, 7 lines
    assert "SYS ×16" in picture.text


def test_an_8_gpu_nvlink_mesh_bends_lines_around_boxes_and_keeps_the_sys_pairs_together():
    picture = Picture(load_machine("8x-v100-dgx1"))
    nvlink = sorted(pairs_of(link)[0] for link in picture.links if link.get("data-link").startswith("NV"))
    assert nvlink == sorted(p for p, label in detect_labels(load_machine("8x-v100-dgx1")).items() if label.startswith("NV"))
    (sys_link,) = [link for link in picture.links if link.get("data-link") == "SYS"]
    assert len(pairs_of(sys_link)) == 12
    widths = {link.get("data-link"): float(picture.strokes(link)[0].get("stroke-width")) for link in picture.links}
    assert widths["NV2"] > widths["NV1"] > widths["SYS"]


def test_a_pair_nvml_did_not_report_is_drawn_as_unknown_without_p2p():
    profile = load_machine("4x-a100-pcie-nvlink-pairs")
    profile = replace(profile, pairs=tuple(p for p in profile.pairs if (p.a, p.b) != (0, 3)))
    picture = Picture(profile)
    (link,) = [link for link in picture.links if (0, 3) in pairs_of(link)]
    assert link.get("data-link") == "?" and link.get("data-p2p") == "unknown"
    assert picture.strokes(link)[0].get("stroke-dasharray") == P2P_DASH


def test_mig_and_one_gpu():
    picture = Picture(load_machine("1x-a100-mig"))
    assert list(picture.boxes) == [0] and picture.links == []
    assert "MIG on: 3g.40gb ×2" in picture.box_text[0] and "One GPU" in picture.text
    pending = Picture(odd_machine("2x-a100-mig-pending"))
    assert "MIG off → on at the next GPU reset" in pending.box_text[1] and "MIG" not in pending.box_text[0]


def test_a_machine_without_gpu_gets_a_picture_that_says_why():
    profile = load_machine("cpu-only")
    picture = Picture(profile)
    assert picture.boxes == {} and picture.links == []
    assert "No GPU to draw" in picture.text and "libnvidia-ml.so.1" in picture.text


# ----------------------------------------------------------------------------------------------------------- the CLI

def test_detect_writes_the_picture_and_says_where(tmp_path, capsys):
    target = tmp_path / "topo.svg"
    assert main(["detect", "--machine", "4x-rtx3090-nvlink-pairs", "--topology-svg", str(target)]) == 0
    out = capsys.readouterr().out
    assert "GPU0  X     NV4   PHB   PHB" in out  # detect's own report is still there
    assert out.rstrip().splitlines()[-1] == f"wrote the topology picture to {target}"
    assert target.read_text() == render_topology_svg(load_machine("4x-rtx3090-nvlink-pairs"))


def test_detect_draws_a_saved_snapshot_and_keeps_json_on_stdout(tmp_path, capsys):
    snapshot = tmp_path / "box.json"
    assert main(["detect", "--machine", "8x-a100-pcie-switches", "--save", str(snapshot), "--json"]) == 0
    capsys.readouterr()
    target = tmp_path / "box.svg"
    assert main(["detect", "--machine", str(snapshot), "--json", "--topology-svg", str(target)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["format"] == "hf_gpu_train.machine"
    assert f"wrote the topology picture to {target}" in captured.err
    assert len(Picture(load_machine(str(snapshot))).boxes) == 8 and target.stat().st_size > 0


def test_a_missing_directory_or_a_directory_is_a_usage_error_without_traceback(tmp_path, capsys):
    missing = tmp_path / "no-such-dir" / "topo.svg"
    assert main(["detect", "--machine", "8x-h100-sxm", "--topology-svg", str(missing)]) == 2
    captured = capsys.readouterr()
    assert f"the directory {missing.parent} does not exist" in captured.err and "Traceback" not in captured.err
    assert captured.out == "" and not missing.parent.exists()  # checked before anything is printed or written
    assert main(["detect", "--machine", "8x-h100-sxm", "--topology-svg", str(tmp_path)]) == 2
    assert "that is a directory" in capsys.readouterr().err


def test_a_write_that_fails_is_a_usage_error(tmp_path, capsys, monkeypatch):
    import hf_gpu_train.report.topology_picture as topology_picture

    def refuse(profile, path):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(topology_picture, "save_topology_svg", refuse)
    assert main(["detect", "--machine", "1x-t4", "--topology-svg", str(tmp_path / "t.svg")]) == 2
    assert "cannot write it: Permission denied" in capsys.readouterr().err


def test_cpu_only_writes_the_no_gpu_picture_and_exits_0(tmp_path, capsys):
    target = tmp_path / "cpu.svg"
    assert main(["detect", "--machine", "cpu-only", "--topology-svg", str(target)]) == 0
    assert "(no GPU to draw: the picture says why)" in capsys.readouterr().out
    assert "No GPU to draw" in target.read_text()


def test_drawing_does_not_import_torch(tmp_path):
    code = ("import sys; from hf_gpu_train.cli import main; "
            f"rc = main(['detect', '--machine', '8x-v100-dgx1', '--topology-svg', {str(tmp_path / 't.svg')!r}]); "
            "assert 'torch' not in sys.modules, 'detect --topology-svg imported torch'; sys.exit(rc)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "t.svg").exists()


DOC_PICTURES = sorted((Path(__file__).resolve().parents[2] / "docs" / "images").glob("topology-*.svg"))


@pytest.mark.parametrize("path", DOC_PICTURES, ids=[p.stem for p in DOC_PICTURES])
def test_the_pictures_in_the_docs_are_what_detect_draws_today(path):
    name = path.stem.removeprefix("topology-")
    assert path.read_text(encoding="utf-8") == render_topology_svg(load_machine(name)), (
        f"{path.name} is stale: hf-gpu-train detect --machine {name} --topology-svg docs/images/{path.name}")


def test_the_docs_show_the_three_kinds_of_machine():
    assert {p.stem for p in DOC_PICTURES} >= {"topology-8x-h100-sxm", "topology-4x-rtx3090-nvlink-pairs",
                                               "topology-8x-a100-pcie-switches"}
