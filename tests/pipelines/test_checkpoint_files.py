"""The files of a run's folder that a restart reads: Ray Train's record of its checkpoints is
set aside when a killed driver left it torn (the end-to-end case is in
test_replay_after_crash.py); a killed rank's report folder is removed when the rank restarts."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipelines.train.checkpoint import RAY_SNAPSHOT, remove_stale_scratch, report_scratch, set_aside_torn_ray_snapshot


@pytest.mark.parametrize("torn", ["", '{"checkpoint_results": [{"check', "\xff\xfe"], ids=["empty", "cut", "binary"])
def test_a_torn_ray_record_is_set_aside_and_a_sound_or_missing_one_is_left(tmp_path, torn):
    assert set_aside_torn_ray_snapshot(tmp_path) is None  # none there
    sound = json.dumps({"ray_version": "2.60.0", "checkpoint_results": []})
    (tmp_path / RAY_SNAPSHOT).write_text(sound)
    assert set_aside_torn_ray_snapshot(tmp_path) is None
    assert (tmp_path / RAY_SNAPSHOT).read_text() == sound
    (tmp_path / RAY_SNAPSHOT).write_bytes(torn.encode("latin-1"))
    aside = set_aside_torn_ray_snapshot(tmp_path)
    assert aside == tmp_path / f"{RAY_SNAPSHOT}.torn" and aside.read_bytes() == torn.encode("latin-1")
    assert not (tmp_path / RAY_SNAPSHOT).exists()


def test_a_restarted_rank_removes_only_its_own_runs_leftover_report_folders(tmp_path, monkeypatch):
    """A rank killed during a report leaves its folder (a copy of the model) in the temporary
    directory; the restarted rank removes it, and no other rank's or run's, live or not."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    run, other = (
        SimpleNamespace(ray_run_name="digits-cnn-a1b2c3"),
        SimpleNamespace(ray_run_name="x.r0.digits-cnn-a1b2c3"),
    )
    killed = (  # a rank that dies hard in the middle of a report
        "import os, sys, types; from pipelines.train.checkpoint import report_scratch; "
        "t = report_scratch(types.SimpleNamespace(ray_run_name='digits-cnn-a1b2c3'), 0); d = t.name; "
        "open(os.path.join(d, 'model.pt'), 'wb').write(b'weights'); print(d); sys.stdout.flush(); os._exit(1)"
    )
    out = subprocess.run(
        [sys.executable, "-c", killed], env={**os.environ, "TMPDIR": str(tmp_path)}, capture_output=True, text=True
    )
    left = out.stdout.strip()
    assert out.returncode == 1 and (Path(left) / "model.pt").is_file(), out.stderr
    keep = [
        report_scratch(run, 1),  # the other rank of the same run
        report_scratch(other, 0),  # another run, whose Ray name ends like this one's
        report_scratch(SimpleNamespace(ray_run_name="digits-cnn-a1b2c"), 0),
    ]
    (tmp_path / "dp-report-unrelated.r0.digits-cnn-a1b2c3.txt").write_text("a file, not a folder")
    assert Path(left).name.startswith("dp-report-") and Path(left).parent == tmp_path
    assert remove_stale_scratch(run, 0) == 1
    assert not Path(left).exists() and all(Path(k.name).is_dir() for k in keep)
    assert remove_stale_scratch(run, 0) == 0
    with report_scratch(run, 0) as live:  # a report of the restarted rank cleans up after itself
        assert Path(live).is_dir()
    assert not Path(live).exists()
