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
import time
from pathlib import Path

from dpcore import DPConfigError

KEY_FILE = ".cache-key"


def _write_new(path: Path, data: bytes) -> None:
    """Create ``path`` (mode 600; FileExistsError if it exists) and write ``data`` to disk."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_once(path: Path, data: bytes) -> None:
    """Create ``path`` (mode 600) holding ``data``, unless it exists: whole, through a hard link
    where the filesystem has them, else by an exclusive create (a reader may then briefly see it
    short, and waits)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{os.urandom(4).hex()}")
    _write_new(tmp, data)
    try:
        os.link(tmp, path)  # atomic: the first process's key wins, whole
    except FileExistsError:
        pass
    except OSError:  # no hard links here (some network and FUSE filesystems)
        try:
            _write_new(path, data)
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)


def _key(storage_path: str | Path) -> bytes:
    root = Path(storage_path).resolve()
    path = root / KEY_FILE
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            _write_once(path, os.urandom(32))
        for _ in range(100):
            key = path.read_bytes()
            if len(key) == 32:
                return key
            time.sleep(0.01)  # another process is writing it (no hard links)
    except OSError as e:
        raise DPConfigError(f"the data caches' key {path} cannot be made or read ({e}); check storage_path.") from None
    raise DPConfigError(f"{path} is not a 32-byte key; remove it (the data caches are then rebuilt).")


def cache_digest(storage_path: str | Path, payload: bytes, length: int) -> str:
    """The first ``length`` hex digits of HMAC-SHA-256(key of ``storage_path``, ``payload``)."""
    return hmac.new(_key(storage_path), payload, hashlib.sha256).hexdigest()[:length]
