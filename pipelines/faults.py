"""Fault injection for the crash tests: a test hook, never part of a user's config.

:func:`pipelines.train.run` takes ``faults=FaultInjection(at_step=k, rank=r)``: worker ``r``
dies hard (``os._exit``, no cleanup, no report) once, right after step ``k`` and before that
step's report. When rank 0 dies, the replay log first holds every release up to step ``k``,
or all but the last ``unlogged`` of them (a crash between the ledger's record of a release and
the log's: the window in which a release is paid for but cannot be replayed). With
``in_upload``, the rank dies instead while it uploads its part of step ``k``'s checkpoint; with
``before_record``, rank 0 dies in step ``k`` after the all-reduce, before its ledger records it. The marker file
``fault-injected`` in the run folder keeps the restarted group
from dying again. It is carried to the workers beside the plan, not in it, so it is neither
logged to MLflow nor kept for ``--resume``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import dpcore


@dataclass(frozen=True)
class FaultInjection:
    at_step: int
    rank: int = 1
    unlogged: int = 0
    in_upload: bool = False  # die during this rank's upload of the checkpoint of at_step, not after the step
    before_record: bool = False  # rank 0: die in step at_step after the all-reduce, before the ledger records it

    def check(self, cfg) -> None:
        """Refuse a hook that cannot fire, before anything starts."""
        if cfg.in_process:
            raise dpcore.DPConfigError(
                "fault injection kills a worker process; with in_process the worker is this process. Drop one of them."
            )
        if not (0 <= self.rank < cfg.num_workers):
            raise dpcore.DPConfigError(f"fault rank={self.rank} must be a worker rank in [0, {cfg.num_workers}).")
        if self.unlogged and (self.rank != 0 or not cfg.replay_log):
            raise dpcore.DPConfigError("unlogged releases need rank=0 and the replay log: rank 0 writes it.")
        if self.before_record and (self.rank != 0 or self.at_step < 2):
            raise dpcore.DPConfigError("before_record needs rank=0 (it records) and at_step ≥ 2.")

    def maybe_fail(self, run_dir: str, rank: int, step: int, journal: str | None = None, replay_log=None) -> None:
        """Die after ``step`` if this is the chosen rank. With ``journal``, first wait (up to
        30 s) until rank 0 has recorded that step's release in it: "after step k" then means
        after its release is on record, whatever the machine's load. (Without the wait, the
        kill of the group that follows this death can overtake rank 0's record of the step:
        privacy-safe, since nothing computed from an unrecorded release survives, but the
        test would not know which releases to expect.)"""
        marker = Path(run_dir) / "fault-injected"
        if self.before_record and step == self.at_step - 1 and rank == self.rank and not marker.exists():
            self._die_before_record(marker)
            return
        if step != self.at_step or rank != self.rank or self.before_record:
            return
        if marker.exists():
            return
        if self.in_upload:
            self._die_in_upload(run_dir, rank, step, marker)
            return
        if journal is not None:
            deadline = time.monotonic() + 30.0
            while time.monotonic() < deadline and not _recorded(journal, step):
                time.sleep(0.01)
        if replay_log is not None:
            replay_log.flush()
            if self.unlogged:
                _cut_records(replay_log, self.unlogged)
        marker.write_text(f"rank {rank} died after step {step}\n")
        os._exit(17)  # a hard crash: no cleanup, no report

    def _die_before_record(self, marker: Path) -> None:
        """From the next release on, rank 0's ledger dies when asked to record step ``at_step``:
        the release is noised and all-reduced (the other ranks hold it and step on it), but not
        on record. Nothing computed from it may survive the restart, and it must not be counted."""
        from dpcore.ledger.ledger import PrivacyLedger

        real, at = PrivacyLedger.append, self.at_step

        def append(ledger, event, step, clip_norm, check_budget=True):
            if step == at:
                marker.write_text(f"rank 0 died in step {step} after the all-reduce, before its record\n")
                os._exit(17)
            return real(ledger, event, step, clip_norm, check_budget)

        PrivacyLedger.append = append

    @staticmethod
    def _die_in_upload(run_dir: str, rank: int, step: int, marker: Path) -> None:
        """At this rank's next checkpoint upload (that of ``step``): wait up to 5 s for rank 0 to
        open the replay log's segment after ``step`` (which deletes the one before), then die
        with the upload unfinished. Rank 0 may rotate only once every rank's part is stored, so
        the wait should time out; if the segment appears, the previous one is gone while the
        checkpoint of ``step`` is incomplete."""
        from ray.train.v2._internal.execution.context import TrainContext

        from dpcore.ledger.replay import segment_path

        segment = segment_path(Path(run_dir) / "replay", step)

        def upload(*args, **kwargs):
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and not segment.exists():
                time.sleep(0.01)
            marker.write_text(f"rank {rank} died in its upload of step {step}; segment there: {segment.exists()}\n")
            os._exit(17)

        TrainContext._upload_checkpoint = upload


def _cut_records(replay_log, n: int) -> None:
    """Cut the last ``n`` records off the replay log's current segment."""
    from dpcore.ledger.replay import read_segment

    seg = replay_log.current
    info = read_segment(seg["path"], replay_log.run, seg["after_step"], replay_log.layout)
    ends = (info.header_end,) + info.ends
    with open(seg["path"], "r+b") as f:
        f.truncate(ends[max(len(info.ends) - n, 0)])


def _recorded(journal: str, step: int) -> bool:
    try:
        lines = Path(journal).read_text().splitlines()
    except OSError:
        return False
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("op") == "append" and rec.get("step") == step:
            return True
    return False
