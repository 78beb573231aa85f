"""The SVG charts: valid XML, data placed where the axes say, ticks that cover the data, a legend per series."""

import xml.etree.ElementTree as ET

import pytest

from hf_gpu_train.svg import Chart, nice_ticks

NS = "{http://www.w3.org/2000/svg}"


@pytest.mark.parametrize("low, high, expected", [
    (0, 100, [0, 20, 40, 60, 80, 100]),
    (0.3, 9.7, [0, 2, 4, 6, 8, 10]),
    (1385, 1410, [1385, 1390, 1395, 1400, 1405, 1410]),
    (-3, 3, [-4, -2, 0, 2, 4]),
])
def test_ticks_are_round_and_cover_the_range(low, high, expected):
    assert nice_ticks(low, high) == pytest.approx(expected)


def test_a_flat_series_still_gets_a_range():
    ticks = nice_ticks(5.0, 5.0)
    assert ticks[0] < 5.0 < ticks[-1] and len(ticks) >= 3
    assert nice_ticks(0.0, 0.0)[0] < 0.0 < nice_ticks(0.0, 0.0)[-1]


def test_non_finite_ranges_are_refused():
    with pytest.raises(ValueError, match="finite"):
        nice_ticks(0.0, float("nan"))


def polyline_points(svg: str) -> list[list[tuple[float, float]]]:
    root = ET.fromstring(svg)
    return [[tuple(map(float, p.split(","))) for p in line.get("points").split()] for line in root.iter(f"{NS}polyline")]


def test_points_land_where_the_ticks_say():
    chart = Chart("t", xlabel="seconds", ylabel="v", width=800, height=300)
    chart.line([0, 10], [0, 100], "a")
    svg = chart.render()
    root = ET.fromstring(svg)
    (line,) = polyline_points(svg)
    frame = [r for r in root.iter(f"{NS}rect") if r.get("stroke") == "black"][0]
    x, y, w, h = (float(frame.get(k)) for k in ("x", "y", "width", "height"))
    assert line[0] == pytest.approx((x, y + h), abs=0.06)  # (0, 0): the bottom-left corner
    assert line[1] == pytest.approx((x + w, y), abs=0.06)  # (10, 100): the top-right corner
    texts = [t.text for t in root.iter(f"{NS}text")]
    assert "t" in texts and "seconds" in texts and "v" in texts and "a" in texts  # title, labels, legend


def test_a_second_axis_has_its_own_scale_and_markers_and_reference_lines_are_drawn():
    chart = Chart("throughput", right_label="data wait (%)")
    chart.line([0, 1, 2], [100, 200, 300], "samples/s")
    chart.line([0, 1, 2], [0, 1, 2], "wait", right=True)
    chart.points([1], [200], "throttled", color="red")
    chart.hline(250, "max clock")
    root = ET.fromstring(chart.render())
    left, right = polyline_points(chart.render())
    assert [p[1] for p in left] == pytest.approx([p[1] for p in right])  # each spans its own axis bottom to top
    assert any(c.get("fill") == "red" for c in root.iter(f"{NS}circle"))
    assert any(line.get("stroke-dasharray") for line in root.iter(f"{NS}line"))
    texts = [t.text for t in root.iter(f"{NS}text")]
    assert "data wait (%)" in texts and "max clock" in texts and "300" in texts and "2" in texts


def test_labels_are_escaped_and_an_empty_chart_renders(tmp_path):
    chart = Chart("a < b & c")
    chart.line([], [], "x & y")
    path = chart.save(tmp_path / "c.svg")
    root = ET.fromstring(path.read_text())
    assert "a < b & c" in [t.text for t in root.iter(f"{NS}text")]


def test_a_base_2_axis_puts_powers_of_two_at_equal_distances():
    from hf_gpu_train.svg import log2_ticks

    assert log2_ticks(3, 40) == [2, 4, 8, 16, 32, 64]
    assert log2_ticks(8, 8) == [8, 16]
    with pytest.raises(ValueError, match="positive"):
        log2_ticks(0, 8)
    chart = Chart("t", xlog2=True)
    chart.line([2, 4, 8], [1, 2, 3], "a")
    (line,) = polyline_points(chart.render())
    assert line[1][0] - line[0][0] == pytest.approx(line[2][0] - line[1][0], abs=0.11)


def test_markers_a_note_and_charts_side_by_side():
    from hf_gpu_train.svg import side_by_side

    left = Chart("speed", width=300).points([1], [2], "failed", color="red", marker="cross")
    left.points([1], [2], "winner", color="gold", marker="star", size=9)
    right = Chart("memory", width=200)
    right.note = "no device memory on the CPU"
    root = ET.fromstring(side_by_side([left, right]))
    assert root.get("width") == "500"
    inner = [e for e in root if e.tag == f"{NS}svg"]
    assert [e.get("x") for e in inner] == ["0", "300"]
    assert any(p.get("stroke") == "red" for p in root.iter(f"{NS}path"))
    assert any(p.get("fill") == "gold" for p in root.iter(f"{NS}polygon"))
    assert "no device memory on the CPU" in [t.text for t in root.iter(f"{NS}text")]


def test_readings_that_are_not_numbers_leave_gaps_instead_of_breaking_the_chart():
    chart = Chart("t", xlog2=True)
    chart.line([1, 2, 4, 8, 0], [1.0, float("nan"), float("inf"), 3.0, 5.0], "a")
    chart.points([float("nan")], [1.0], "b")
    chart.hline(float("inf"), "never")
    root = ET.fromstring(chart.render())
    (line,) = polyline_points(chart.render())
    assert len(line) == 2  # (1, 1) and (8, 3); x=0 has no place on a logarithmic axis
    assert "nan" not in chart.render() and "never" not in [t.text for t in root.iter(f"{NS}text")]

