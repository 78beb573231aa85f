"""The entry gate's evidence that a rank will not come (``collective_gate.not_coming``): only what a late position
cannot undo counts, so a rank seen late is never taken for a rank that went elsewhere."""

from __future__ import annotations

from types import SimpleNamespace

from hf_gpu_train.training.collective_gate import FLAGS, agree_flags, not_coming


def where(step, phase, collectives=0, in_collective=None):
    return {"step": step, "phase": phase, "collectives": collectives, "in_collective": in_collective}


def test_a_rank_that_began_a_later_step_or_waits_in_a_collective_not_entered_here_is_not_coming():
    assert "went on to step 4 (forward)" in not_coming(where(3, "forward"), step=3, collectives=7)
    assert "went on to step 6" in not_coming(where(5, "data"), step=3, collectives=7)
    assert "waits in all_reduce instead (its collective 8; this rank entered 7)" in not_coming(
        where(3, "data", 8, "all_reduce"), step=3, collectives=7)


def test_a_position_seen_late_is_no_evidence():
    assert not_coming(None, step=3, collectives=7) is None  # never published yet
    assert not_coming(where(3, "data"), step=3, collectives=7) is None  # on its way to the call
    assert not_coming(where(2, "optimizer"), step=3, collectives=7) is None  # seen a step ago
    # seen inside the collective both ranks left since (the flags all-reduce before an evaluation): the same count
    assert not_coming(where(3, "data", 7, "all_reduce"), step=3, collectives=7) is None
    assert not_coming(where(3, "evaluation"), step=3, collectives=7) is None


def test_one_process_keeps_its_flags():
    control = SimpleNamespace(**{**dict.fromkeys(FLAGS, False), "should_save": True})
    agree_flags(control, "cpu")
    assert control.should_save and not control.should_evaluate
