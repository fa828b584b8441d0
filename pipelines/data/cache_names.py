"""Names of the platform's own data caches that say nothing about the data.

An ingest cache is keyed by the source files' names, sizes and times, and a feature cache by the
SHA-256 of the shards it was computed from; the folders' names are written into the run's plan,
which MLflow keeps (``spec.json``). A plain hash there would let anyone who reads the plan and
knows every other record test whether a candidate dataset is the one trained on. So the names
are HMAC-SHA-256 digests under a key kept beside the caches (``storage_path/.cache-key``, 32
random bytes, mode 600), which MLflow never sees.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

KEY_FILE = ".cache-key"


def _key(storage_path: str | Path) -> bytes:
    root = Path(storage_path).resolve()
    root.mkdir(parents=True, exist_ok=True)
    path = root / KEY_FILE
    if not path.exists():
        tmp = root / f"{KEY_FILE}.{os.getpid()}.{os.urandom(4).hex()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, os.urandom(32))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # atomic: the first process's key wins, whole
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    key = path.read_bytes()
    if len(key) != 32:
        raise OSError(f"{path} is not a 32-byte cache key; remove it (the caches are then rebuilt).")
    return key


def cache_digest(storage_path: str | Path, payload: bytes, length: int) -> str:
    """The first ``length`` hex digits of HMAC-SHA-256(key of ``storage_path``, ``payload``)."""
    return hmac.new(_key(storage_path), payload, hashlib.sha256).hexdigest()[:length]
