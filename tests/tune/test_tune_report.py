"""NAME.tune_report.md and NAME.tune.svg from results."""

from __future__ import annotations

from dataclasses import replace

from hf_gpu_train.tune.candidates import PlannerVerdict
from hf_gpu_train.tune.plot import write_plot
from hf_gpu_train.tune.results import OK, OOM, SKIPPED, TrialResult, choose
from hf_gpu_train.tune.tune_report import MARK, RunFacts, render_report, write_report
from tests.tune.simulated import space

GIB = 2**30


def results_and_space():
    sp = space(per_process=32, precision="bf16", on_cuda=True)
    sp = replace(sp, verdicts=(PlannerVerdict(32, False, "bf16", 60 * GIB, 73 * GIB, True),
                               PlannerVerdict(16, False, "bf16", 30 * GIB, 73 * GIB, True)))
    b = sp.base
    results = [TrialResult(b, OOM, "injected", samples_per_s=50.0, tokens_per_s=1000.0, rescued_micro_batch=16, failed_micro_batch=32,
                           peak_memory_bytes=70 * GIB, device_memory_bytes=80 * GIB, seconds=4.0),
               TrialResult(b.with_micro_batch(16), OK, samples_per_s=60.0, tokens_per_s=1200.0, peak_memory_bytes=33 * GIB,
                           device_memory_bytes=80 * GIB, data_wait_pct=1.0, seconds=3.0, from_cache=True),
               TrialResult(replace(b.with_micro_batch(16), torch_compile=True), SKIPPED, "budget: 1 s of 60 s left")]
    return sp, results


def test_the_report_has_the_table_the_planner_error_and_what_was_not_tried():
    sp, results = results_and_space()
    facts = RunFacts(config_file="box.yaml", machine="h200", command="hf-gpu-train tune ...", when="now", budget_s=60.0,
                     spent_s=7.0, startup_s=12.5, wall_s=30.0, written=("box.plan.json: per_device_train_batch_size",))
    text = render_report(facts, sp, choose(results, sp.metric, sp.base), results, ["micro-batch: 32 does not fit"], "box.tune.svg")
    assert text.startswith(MARK)
    assert "**micro-batch 16 x 2, checkpointing off, 0 worker(s), bf16**" in text
    # planner 30 GiB against a measured 33 GiB: +10.0%; the rescued trial is in the table but never the winner
    assert "| 2 | 16 | 2 | off | 0 | bf16 | off | 1,200.0 | 60.0 | - | 33.00 | 30.00 | +10.0 | 1.0 | - | - | 3.0 (saved) | ok |" in text
    assert "| oom (rescued at 16) |" in text and "skipped: budget: 1 s of 60 s left |" in text
    assert "- micro-batch: 32 does not fit" in text and "![tokens/s and peak memory against the micro-batch](box.tune.svg)" in text
    assert "model and data loaded in 12.5 s" in text and "- box.plan.json: per_device_train_batch_size" in text


def test_an_earlier_report_of_someone_else_is_kept(tmp_path):
    theirs = tmp_path / "box.tune_report.md"
    theirs.write_text("my notes")
    assert write_report(theirs, MARK + "\nnew", "S") == tmp_path / "box.tune_report.md.bak-S"
    assert (tmp_path / "box.tune_report.md.bak-S").read_text() == "my notes"
    assert write_report(theirs, MARK + "\nnewer", "S2") is None  # ours: rewritten
    assert theirs.read_text() == MARK + "\nnewer"


def test_the_plot_marks_the_winner_the_failure_and_the_memory_lines_and_nothing_is_drawn_without_a_trial(tmp_path):
    import xml.etree.ElementTree as ET

    sp, results = results_and_space()
    path = write_plot(tmp_path / "box.tune.svg", results, sp, results[1])
    root = ET.fromstring(path.read_text())
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert {"winner", "out of memory / over headroom", "device memory", "90% headroom line", "planner estimate"} <= set(texts)
    assert "GiB per process" in texts and "16" in texts and "32" in texts  # micro-batch ticks, powers of two
    assert any(p.get("stroke") == "red" for p in root.iter("{http://www.w3.org/2000/svg}path"))  # the OOM trial's cross
    assert write_plot(tmp_path / "none.svg", results[2:], sp, None) is None and not (tmp_path / "none.svg").exists()
