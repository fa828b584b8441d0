"""A new MLflow SQLite database, made from a cached copy of MLflow's own schema.

MLflow builds a new SQLite store by creating its first tables and then running every schema
migration since (68 in MLflow 3.17), which took about 1.2 s of CPU on this repository's 2-core
machine, at the start of every run in a new folder, of every test, and of a sweep's first call.
:func:`create_if_missing` builds that empty database once per user and version (with MLflow's
own ``_initialize_tables``, the function its store calls), keeps it in a private cache, and copies
it to a database path that does not exist yet. MLflow then opens the copy as the database it
would have built: its tables exist, its schema is at the head revision (MLflow checks), and the
default experiment, whose artifact location depends on where the store is opened, is created
by MLflow itself on first open, as for a database it had built.

The cache is ``$XDG_CACHE_HOME/dp-platform/mlflow-schema`` (else ``~/.cache/...``). It must be a
folder of this user that no one else can write to, nor any folder above it unless sticky
(:func:`dpcore.native_build.private_cache`): a database copied from there is the run's record.
Otherwise, or when anything fails, nothing is copied and MLflow builds the database itself.
``DP_MLFLOW_SCHEMA_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sqlite3
import tempfile
from pathlib import Path

from dpcore.native_build import private_cache

log = logging.getLogger(__name__)


def _key() -> str:
    """What the schema depends on: MLflow's, SQLAlchemy's, Alembic's and SQLite's versions and
    MLflow's migration scripts (their names and contents)."""
    import alembic
    import mlflow
    import sqlalchemy

    from ..logs import library_imported

    library_imported()  # MLflow's first import replaces its logger's handlers: to the command's log file again
    versions = Path(mlflow.__file__).parent / "store" / "db_migrations" / "versions"
    digest = hashlib.sha256()
    for part in (mlflow.__version__, sqlalchemy.__version__, alembic.__version__, sqlite3.sqlite_version):
        digest.update(part.encode() + b"\0")
    for script in sorted(versions.glob("*.py")):
        digest.update(script.name.encode() + b"\0" + script.read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def build(path: Path) -> None:
    """An empty MLflow database at ``path`` (a new file), as MLflow's store builds one: its first
    tables, then every migration; its schema is then checked to be at the head revision."""
    import sqlalchemy
    from mlflow.store.db import utils

    engine = sqlalchemy.create_engine(f"sqlite:///{path}")
    try:
        utils._initialize_tables(engine)
        utils._verify_schema(engine)
    finally:
        engine.dispose()


def template() -> Path | None:
    """The cached empty database for this MLflow, built on first use (None: no private cache).
    Raises what a failed build raised."""
    cache = private_cache("mlflow-schema")
    if cache is None:
        return None
    target = cache / f"mlflow-{_key()}.db"
    if target.is_file():
        return target
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=cache)
    os.close(fd)
    try:
        build(Path(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())  # whole on disk before it is named: a torn template would fail every new store
        os.replace(tmp, target)  # atomic: concurrent builders are safe
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def create_if_missing(path: str | Path) -> bool:
    """Copy the cached empty database to ``path`` if nothing is there yet. True if it did; False
    leaves the database to MLflow (it exists, the cache is off, not private or not writable, or
    anything failed: this only saves time, it never stops a run)."""
    path = Path(path)
    try:
        if path.exists() or os.environ.get("DP_MLFLOW_SCHEMA_CACHE", "1") == "0":
            return False
    except OSError:  # a folder that cannot be searched: MLflow reports it in its own words
        return False
    try:
        source = template()
    except Exception as e:  # noqa: BLE001 - e.g. a read-only cache: MLflow builds the database
        log.info("no cached MLflow schema (%s: %s); MLflow builds the database", type(e).__name__, e)
        return False
    if source is None:
        return False
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        shutil.copyfile(source, tmp)
        os.chmod(tmp, 0o644 & ~_umask())  # the mode SQLite gives a database it creates
        os.link(tmp, path)  # never over a database another process made meanwhile
        return True
    except OSError as e:  # FileExistsError: another process made it first; it is theirs
        if not isinstance(e, FileExistsError):
            log.info("could not copy the cached MLflow schema to %s (%s); MLflow builds it", path, e)
        return False
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def _umask() -> int:
    """This process's umask, read without changing it (os.umask would, for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022
