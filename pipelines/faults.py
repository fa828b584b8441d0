"""Fault injection for the crash tests: a test hook, never part of a user's config.

:func:`pipelines.train.run` takes ``faults=FaultInjection(at_step=k, rank=r)``: worker ``r``
dies hard (``os._exit``, no cleanup, no report) once, right after step ``k`` and before that
step's report. When rank 0 dies, the replay log first holds every release up to step ``k``,
or all but the last ``unlogged`` of them (a crash between the ledger's record of a release and
the log's: the window in which a release is paid for but cannot be replayed). With
``in_upload``, the rank dies instead while it uploads its part of step ``k``'s checkpoint; with
``before_record``, rank 0 dies in step ``k`` after the all-reduce, before its ledger records it;
with ``torn_record``, rank 0 dies in the middle of writing step ``k``'s journal record (half the
line is on disk, fsynced: the torn last line a crash mid-write leaves). The marker file
``fault-injected`` in the run folder keeps the restarted group from dying again. With
``again_in_replay=r``, the restarted group's rank ``r`` then dies once more (marker
``fault-injected-again``) while it restores: after it has applied the first update the replay
log carried to it (:meth:`FaultInjection.arm_replay`, called by the worker's restore). The hook
is carried to the workers beside the plan, not in it, so it is neither logged to MLflow nor
kept for ``--resume``.
"""

from __future__ import annotations

import hashlib
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
    torn_record: bool = False  # rank 0: die in step at_step half-way through writing its journal record
    again_in_replay: int | None = None  # this rank of the restarted group dies again, in its replay

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
        if (self.before_record or self.torn_record) and (self.rank != 0 or self.at_step < 2):
            raise dpcore.DPConfigError("before_record and torn_record need rank=0 (it records) and at_step ≥ 2.")
        if self.before_record and self.torn_record:
            raise dpcore.DPConfigError("before_record and torn_record are two ways to die in one step: choose one.")
        if self.again_in_replay is not None:
            if not (0 <= self.again_in_replay < cfg.num_workers) or not cfg.replay_log or cfg.max_failures < 2:
                raise dpcore.DPConfigError(
                    "again_in_replay needs a worker rank, the replay log and max_failures ≥ 2 (two crashes)."
                )

    def maybe_fail(self, run_dir: str, rank: int, step: int, journal: str | None = None, replay_log=None) -> None:
        """Die after ``step`` if this is the chosen rank. With ``journal``, first wait (up to
        30 s) until rank 0 has recorded that step's release in it: "after step k" then means
        after its release is on record, whatever the machine's load. (Without the wait, the
        kill of the group that follows this death can overtake rank 0's record of the step:
        privacy-safe, since nothing computed from an unrecorded release survives, but the
        test would not know which releases to expect.)"""
        marker = Path(run_dir) / "fault-injected"
        in_step = self.before_record or self.torn_record
        if in_step and step == self.at_step - 1 and rank == self.rank and not marker.exists():
            if self.torn_record:
                self._die_mid_record(marker, replay_log)
            else:
                self._die_before_record(marker)
            return
        if step != self.at_step or rank != self.rank or in_step:
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

    def _die_mid_record(self, marker: Path, replay_log) -> None:
        """From the next release on, rank 0 dies while writing the journal record of step
        ``at_step``: the first half of the line reaches the disk (fsynced), its end and newline
        never do. The marker says how many intact bytes the journal held before it, with their
        SHA-256, so that a test can check that the repair kept every one of them. The replay log
        is flushed first: it then holds every release before ``at_step``, whatever the load."""
        from dpcore.ledger.journal import Journal

        if replay_log is not None:
            replay_log.flush()
        real, at = Journal.write, self.at_step

        def write(journal, record):
            if record.get("op") == "append" and record.get("step") == at:
                line = (json.dumps(record) + "\n").encode()
                with open(journal.path, "rb") as f:
                    intact = f.read()
                with open(journal.path, "ab") as f:
                    f.write(line[: len(line) // 2])
                    f.flush()
                    os.fsync(f.fileno())
                marker.write_text(
                    f"rank 0 died writing step {at}'s journal record: {len(line) // 2} of {len(line)} bytes "
                    f"on disk after {len(intact)} intact bytes (sha256 {hashlib.sha256(intact).hexdigest()})\n"
                )
                os._exit(17)
            return real(journal, record)

        Journal.write = write

    def arm_replay(self, run_dir: str, rank: int, optimizer) -> None:
        """Called by every rank's restore before it replays the logged updates: with
        ``again_in_replay``, and only in a group restarted after this hook's first fault, that
        rank dies (once) right after it has applied the first replayed update, with the others
        still to come."""
        again = Path(run_dir) / "fault-injected-again"
        if self.again_in_replay != rank or not (Path(run_dir) / "fault-injected").exists() or again.exists():
            return
        real = optimizer.replay

        def replay(*args, **kwargs):
            out = real(*args, **kwargs)
            again.write_text(f"rank {rank} died again in its replay, after applying one update\n")
            os._exit(17)
            return out

        optimizer.replay = replay

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
