"""The data caches' folder names, which the run's plan (in MLflow) carries, are keyed digests:
stable for one storage folder (so the caches are re-used), unrelated to a plain hash of what
they key, and different under another storage folder's key."""

import hashlib
import stat

from pipelines.data.cache_names import KEY_FILE, cache_digest


def test_cache_names_are_keyed_and_stable(tmp_path):
    payload = b'{"files": [["/data/t.csv", 1234, 5678]]}'
    a = cache_digest(tmp_path / "a", payload, 12)
    assert a == cache_digest(tmp_path / "a", payload, 12)  # the same cache is found again
    assert a != hashlib.sha256(payload).hexdigest()[:12]  # not a plain hash anyone can recompute
    assert a != cache_digest(tmp_path / "b", payload, 12)  # another storage folder, another key
    assert a != cache_digest(tmp_path / "a", payload + b" ", 12)
    key = tmp_path / "a" / KEY_FILE
    assert len(key.read_bytes()) == 32 and stat.S_IMODE(key.stat().st_mode) == 0o600
    assert [p.name for p in (tmp_path / "a").iterdir()] == [KEY_FILE]  # no temporary file left


def test_the_ingest_cache_folder_is_named_by_the_keyed_digest(tmp_path):
    from pipelines.config import TrainConfig
    from pipelines.plan import prepare_data

    cfg = TrainConfig(storage_path=str(tmp_path / "runs"), tracking_uri=f"sqlite:///{tmp_path}/m.db")
    first, _ = prepare_data(cfg)
    again, _ = prepare_data(cfg)
    assert first == again and first.parent == tmp_path.resolve() / "runs" / "datasets"
    name = first.name.split("-")[1]
    assert len(name) == 12 and (tmp_path / "runs" / KEY_FILE).is_file()


def test_a_filesystem_without_hard_links_still_gets_one_whole_key(tmp_path, monkeypatch):
    import os

    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    a = cache_digest(tmp_path, b"x", 12)
    assert a == cache_digest(tmp_path, b"x", 12) and len((tmp_path / KEY_FILE).read_bytes()) == 32
    assert [p.name for p in tmp_path.iterdir()] == [KEY_FILE]


def test_an_edit_that_sets_the_modification_time_back_is_ingested_again(tmp_path):
    """cp -p, rsync -t and tar x restore a file's mtime: the cache keyed by name, size and mtime
    alone re-used the old content (helper-36). The change time cannot be set back."""
    import os
    import time

    import numpy as np
    from PIL import Image

    from pipelines.config import TrainConfig
    from pipelines.plan import prepare_data

    tree = tmp_path / "tree"
    for c in ("a", "b"):
        (tree / c).mkdir(parents=True)
        for i in range(5):
            Image.fromarray(np.full((4, 4, 3), 10 * i, np.uint8)).save(tree / c / f"{i}.bmp")
    cfg = TrainConfig(
        dataset="imagefolder",
        data_dir=str(tree),
        storage_path=str(tmp_path / "runs"),
        tracking_uri=f"sqlite:///{tmp_path}/m.db",
    )
    first, _ = prepare_data(cfg)
    assert prepare_data(cfg)[0] == first  # unchanged: re-used
    target = tree / "a" / "0.bmp"
    before = target.stat()
    time.sleep(0.01)
    Image.fromarray(np.full((4, 4, 3), 250, np.uint8)).save(target)  # the same size (uncompressed)
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (target.stat().st_size, target.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert prepare_data(cfg)[0] != first
