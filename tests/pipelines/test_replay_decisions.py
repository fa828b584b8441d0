"""Issue L, bad input: how far a restart may replay, decided by rank 0 from the ledger and the
replay log. A foreign log is refused, a corrupt record ends what is replayed, and what is not
replayed is rolled back and stays counted."""

from types import SimpleNamespace

import pytest
import torch

import dpcore
from dpcore.ledger.replay import ReplayWriter, layout_of, read_segment, segment_path
from pipelines.train import replay

from ..helpers import tiny_mlp

EVENT = dpcore.PrivacyEvent.dpsgd_step(1.2, 0.05)


def _setup(tmp_path, logged_steps, run="run-7f3a2c", replay_log=True):
    tmp_path.mkdir(exist_ok=True)
    plan = SimpleNamespace(run_dir=str(tmp_path), ray_run_name=run, config={"replay_log": replay_log})
    ledger = dpcore.PrivacyLedger(8.0, 1e-5, journal=tmp_path / "ledger.journal.jsonl")
    for s in range(1, 9):  # the checkpoint is at step 5; releases 6, 7 and 8 came after it
        ledger.append(EVENT, step=s, clip_norm=1.0)
    params = dict(tiny_mlp().named_parameters())
    w = ReplayWriter(replay.folder(plan), "run-7f3a2c", layout_of(params), 5)
    for s in logged_steps:
        w.append(s, [torch.randn_like(p) for p in params.values()])
    w.close()
    return plan, ledger, layout_of(params)


def test_the_log_carries_the_checkpoint_as_far_as_it_holds_committed_releases(tmp_path):
    plan, ledger, layout = _setup(tmp_path, [6, 7])  # release 8 was paid for but never logged
    segment, upto = replay.replayable(plan, ledger, 5, layout)
    assert upto == 7 and segment.steps == (6, 7)


def test_a_log_of_another_run_is_refused_and_nothing_is_replayed(tmp_path):
    plan, ledger, layout = _setup(tmp_path, [6, 7, 8], run="run-other")
    with pytest.warns(UserWarning, match="replay log refused: .* belongs to run 'run-7f3a2c'.*stay counted as spent"):
        segment, upto = replay.replayable(plan, ledger, 5, layout)
    assert (segment, upto) == (None, 5)


def test_a_corrupt_record_ends_the_replay_there(tmp_path):
    plan, ledger, layout = _setup(tmp_path, [6, 7, 8])
    path = segment_path(replay.folder(plan), 5)
    seg = read_segment(path, "run-7f3a2c", 5, layout)
    raw = bytearray(path.read_bytes())
    raw[seg.spans[1][0]] ^= 0x01  # one bit of release 7's update
    path.write_bytes(bytes(raw))
    with pytest.warns(UserWarning, match="fails its checksum: steps 7–8 are rolled back and stay counted"):
        segment, upto = replay.replayable(plan, ledger, 5, layout)
    assert upto == 6


def test_releases_already_rolled_back_are_never_replayed_and_the_option_turns_it_off(tmp_path):
    plan, ledger, layout = _setup(tmp_path, [6, 7, 8])
    ledger.mark_rolled_back(6)  # an earlier restart (without the log) rolled 7 and 8 back
    assert replay.replayable(plan, ledger, 5, layout)[1] == 6
    plan, ledger, layout = _setup(tmp_path / "off", [6, 7, 8], replay_log=False)
    assert replay.replayable(plan, ledger, 5, layout) == (None, 5)
