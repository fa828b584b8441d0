"""The files of a run's folder that a restart reads: Ray Train's record of its checkpoints is
set aside when a killed driver left it torn (the end-to-end case is in
test_replay_after_crash.py)."""

import json

import pytest

from pipelines.train.checkpoint import RAY_SNAPSHOT, set_aside_torn_ray_snapshot


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
