"""The driver's progress line (K, must-show 4): start-up phases on the line, a line for every
phase after the last step, and an ETA from the measured step rate after warm-up, checkpoint
pauses included."""

from __future__ import annotations

import io
import json

import pytest

from pipelines.train.progress import PHASES_FILE, JournalProgress, estimate_eta, note_phase

from ..helpers import small_plan


def _schedule(total=100, every=10, step_s=0.1, pause_s=2.0, first_s=3.0):
    """(step, time) of each release: a slow first step, then steps of step_s, with a checkpoint
    report of pause_s after every `every` steps (as the worker loop does)."""
    t, out = first_s, []
    for s in range(1, total + 1):
        if s > 1:
            t += step_s + (pause_s if (s - 1) % every == 0 else 0.0)
        out.append((s, t))
    return out


@pytest.mark.parametrize("every,pause_s", [(10, 2.0), (10, 0.0), (25, 5.0)])
def test_eta_counts_checkpoint_pauses_once_it_has_measured_one(every, pause_s):
    total = 100
    sched = _schedule(total=total, every=every, pause_s=pause_s)
    end = sched[-1][1]
    for i in range(len(sched) - 1):
        done, now = sched[i]
        eta = estimate_eta(sched[: i + 1], every, total)
        truth = end - now
        if done <= every:  # warm-up: no checkpoint measured yet, and more are to come
            assert eta is None, (done, eta)
        elif done >= every + 3:
            assert eta == pytest.approx(truth, rel=0.05, abs=0.15), (done, eta, truth)
    # what the line showed before (the rate of the steps seen so far) is about 3× too low early on
    done, now = sched[every - 1]
    naive = (total - done) * (now - sched[0][1]) / (done - 1)
    if pause_s:
        assert naive < 0.6 * (end - now)


def test_eta_without_checkpoints_to_come_needs_only_the_steps():
    sched = _schedule(total=30, every=30, pause_s=9.0)
    assert estimate_eta(sched[:2], 30, 30) is None  # one gap: still warming up
    assert estimate_eta(sched[:10], 30, 30) == pytest.approx(20 * 0.1)


def _journal(path, steps, eps=1.0):
    with open(path, "a", encoding="utf-8") as f:
        for s, t in steps:
            f.write(json.dumps({"op": "append", "step": s, "timestamp": t, "epsilon": eps}) + "\n")


def test_an_earlier_steps_epsilon_is_shown_with_its_step(tmp_path):
    """The ledger computes ε every k releases: where the last step's is not known yet, the line
    says which step its ε is of (it showed step 52's ε beside "step 53/53")."""
    plan = small_plan(run_dir=str(tmp_path), journal=str(tmp_path / "journal"), steps=3, checkpoint_every=3)
    out = io.StringIO()
    p = JournalProgress(plan, enabled=True, stream=out)
    _journal(plan.journal, [(1, 10.0), (2, 10.1)], eps=0.5)
    _journal(plan.journal, [(3, 10.2)], eps=None)
    p._poll()
    p.steps_done()
    assert "step 3/3  ε=0.500 (step 2)" in out.getvalue()
    _journal(plan.journal, [(4, 10.3)], eps=0.7)
    p._poll()
    p._print_bar()
    assert out.getvalue().splitlines()[-1].split("  ")[1] == "ε=0.700"


def test_start_up_phases_label_the_line_and_later_phases_get_lines_of_their_own(tmp_path):
    plan = small_plan(run_dir=str(tmp_path), journal=str(tmp_path / "journal"), steps=4, checkpoint_every=2)
    out = io.StringIO()  # not a terminal: a line per update
    clock = iter(range(100)).__next__
    p = JournalProgress(plan, enabled=True, stream=out, clock=lambda: float(clock()))
    p.phase("starting Ray")
    note_phase(plan, "2 worker(s) up; loading the data")
    note_phase(plan, "data loaded (629 training examples on rank 0); the first step")
    p._poll()
    _journal(plan.journal, [(1, 10.0), (2, 10.1)])
    p._poll()
    p._print_bar()
    _journal(plan.journal, [(3, 12.0), (4, 12.1)])
    note_phase(plan, "last step done; evaluating")  # read in the same poll as the last step
    p._poll()
    p.phase("Ray Train finished")
    p.steps_done()  # already shown: not again
    lines = out.getvalue().splitlines()
    assert "] starting Ray  ε=…" in lines[0]
    assert "] 2 worker(s) up; loading the data  ε=…" in lines[1]
    assert "] data loaded (629 training examples on rank 0); the first step  ε=…" in lines[2]
    assert "step 2/4  ε=1.000" in lines[3] and "ETA    …" in lines[3]  # warm-up: no guess
    assert "[########################] step 4/4" in lines[4]
    assert lines[5].startswith("  last step done; evaluating  (") and lines[6].startswith("  Ray Train finished  (")
    assert len(lines) == 7


def test_a_resumed_run_does_not_replay_the_earlier_drivers_phases(tmp_path):
    plan = small_plan(run_dir=str(tmp_path), journal=str(tmp_path / "journal"), steps=4, checkpoint_every=2)
    (tmp_path / PHASES_FILE).write_text("old phase\n")
    out = io.StringIO()
    p = JournalProgress(plan, enabled=True, stream=out)
    note_phase(plan, "new phase")
    p._poll()
    assert "new phase" in out.getvalue() and "old phase" not in out.getvalue()


def test_each_restart_counts_once_whether_it_replayed_rolled_back_or_both(tmp_path):
    plan = small_plan(run_dir=str(tmp_path), journal=str(tmp_path / "journal"), steps=20, checkpoint_every=5)
    out = io.StringIO()
    p = JournalProgress(plan, enabled=True, stream=out)
    _journal(plan.journal, [(s, 10.0 + s) for s in range(1, 9)])
    with open(plan.journal, "a", encoding="utf-8") as f:
        for rec in (
            {"op": "replayed", "after_step": 5, "upto_step": 7},  # restart 1: 6–7 replayed, 8 rolled back
            {"op": "rollback", "after_step": 7},
            {"op": "replayed", "after_step": 5, "upto_step": 9},  # restart 2: all replayed
            {"op": "rollback", "after_step": 5},  # restart 3: without the log
        ):
            f.write(json.dumps(rec) + "\n")
            f.flush()
            if rec["op"] == "replayed" and rec["upto_step"] == 9:
                _journal(plan.journal, [(8, 30.0), (9, 31.0)])
    p._poll()
    p._print_bar()
    assert "step 5/20" in out.getvalue().splitlines()[-1] and "restarts: 3" in out.getvalue().splitlines()[-1]
