"""A new MLflow SQLite database from the cached schema (pipelines.tracking.sqlite_schema): the
database MLflow itself builds, never over an existing one, and only from a private cache."""

import os
import sqlite3
import stat

import pytest

from pipelines import tracking
from pipelines.tracking import sqlite_schema


@pytest.fixture
def cache(tmp_path, monkeypatch):
    home = tmp_path / "cache"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    monkeypatch.delenv("DP_MLFLOW_SCHEMA_CACHE", raising=False)
    return home / "dp-platform" / "mlflow-schema"


def _schema(path) -> tuple:
    """The tables, indexes and schema revision. Each statement's lines (columns, constraints) are
    compared as a set: MLflow's own migrations write a table's constraints in an order that
    changes with the process's hash seed (four databases it built, four orders)."""
    with sqlite3.connect(path) as db:
        objects = sorted(
            (
                kind,
                name,
                table,
                None if sql is None else tuple(sorted(line.strip().rstrip(",") for line in sql.splitlines())),
            )
            for kind, name, table, sql in db.execute(
                "SELECT type, name, tbl_name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"
            )
        )
        version = db.execute("SELECT version_num FROM alembic_version").fetchall()
    return objects, version


def _rows(path) -> dict:
    """Every table's rows, the experiments' times left out (they are the moment MLflow opened it)."""
    with sqlite3.connect(path) as db:
        tables = [n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        out = {}
        for name in tables:
            cols = [c[1] for c in db.execute(f"PRAGMA table_info('{name}')")]
            keep = [c for c in cols if not (name == "experiments" and c.endswith("_time"))]
            out[name] = sorted(db.execute(f"SELECT {', '.join(keep)} FROM '{name}'").fetchall(), key=repr)
    return out


def test_a_new_database_is_the_one_mlflow_builds_and_mlflow_opens_it_as_its_own(cache, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)  # the default experiment's artifact location is under the folder opened from
    ours, theirs = tmp_path / "ours.db", tmp_path / "theirs.db"
    tracking.open_store(f"sqlite:///{ours}")  # every command, before its first MLflow client
    assert ours.is_file() and list(cache.glob("mlflow-*.db"))
    MlflowClient(f"sqlite:///{theirs}").search_experiments()  # MLflow alone: its tables, then 68 migrations
    assert _schema(ours) == _schema(theirs)
    client = MlflowClient(f"sqlite:///{ours}")
    (default,) = client.search_experiments()
    assert default.name == "Default" and default.artifact_location == str(tmp_path / "mlruns" / "0")
    assert _rows(ours) == _rows(theirs)
    run = client.create_run(client.create_experiment("e")).info.run_id  # and it takes runs
    client.log_metric(run, "epsilon", 1.5)
    assert client.get_run(run).data.metrics == {"epsilon": 1.5}
    assert stat.S_IMODE(ours.stat().st_mode) == stat.S_IMODE(theirs.stat().st_mode)


def test_an_existing_database_is_left_as_it_is(cache, tmp_path):
    from mlflow import MlflowClient

    db = tmp_path / "mlflow.db"
    client = MlflowClient(f"sqlite:///{db}")
    run = client.create_run(client.create_experiment("kept")).info.run_id
    before = db.read_bytes()
    assert sqlite_schema.create_if_missing(db) is False
    tracking.check_tracking_uri(f"sqlite:///{db}")
    tracking.open_store(f"sqlite:///{db}")
    assert db.read_bytes() == before and client.get_run(run).info.run_id == run


def test_the_schema_is_built_once_and_then_only_copied(cache, tmp_path, monkeypatch):
    assert sqlite_schema.create_if_missing(tmp_path / "a.db") is True
    built = list(cache.glob("mlflow-*.db"))

    def no_second_build(path):
        raise AssertionError("built again")

    monkeypatch.setattr(sqlite_schema, "build", no_second_build)
    assert sqlite_schema.create_if_missing(tmp_path / "b.db") is True
    assert list(cache.glob("mlflow-*.db")) == built and (tmp_path / "b.db").read_bytes() == built[0].read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")] and not list(cache.glob("*.tmp"))


def test_a_cache_others_can_write_is_not_used_and_mlflow_builds_the_database(cache, tmp_path):
    from mlflow import MlflowClient

    cache.mkdir(parents=True)
    os.chmod(cache, 0o777)  # anyone could plant a database there (not sticky)
    db = tmp_path / "mlflow.db"
    assert sqlite_schema.create_if_missing(db) is False and not db.exists()
    assert not list(cache.iterdir())
    tracking.open_store(f"sqlite:///{db}")
    assert not db.exists()  # left to MLflow, which builds it on first use
    assert [e.name for e in MlflowClient(f"sqlite:///{db}").search_experiments()] == ["Default"]


def test_the_cache_can_be_turned_off(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("DP_MLFLOW_SCHEMA_CACHE", "0")
    assert sqlite_schema.create_if_missing(tmp_path / "mlflow.db") is False
    assert not (tmp_path / "mlflow.db").exists() and not cache.exists()


def test_a_failed_build_leaves_the_database_to_mlflow(cache, tmp_path, monkeypatch):
    def broken(path):
        raise RuntimeError("no such MLflow internals")

    monkeypatch.setattr(sqlite_schema, "build", broken)
    assert sqlite_schema.create_if_missing(tmp_path / "mlflow.db") is False
    assert not (tmp_path / "mlflow.db").exists() and not list(cache.iterdir())


def test_a_cache_that_cannot_be_written_never_stops_a_run(cache, tmp_path, monkeypatch):
    """A private cache on a read-only mount: no schema can be built there; the run goes on."""
    import errno
    import tempfile

    real = tempfile.mkstemp

    def read_only(*args, dir=None, **kwargs):
        if dir is not None and str(dir).startswith(str(cache)):
            raise OSError(errno.EROFS, "Read-only file system", str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(sqlite_schema.tempfile, "mkstemp", read_only)
    db = tmp_path / "mlflow.db"
    assert sqlite_schema.create_if_missing(db) is False
    tracking.open_store(f"sqlite:///{db}")  # no error
    assert not db.exists()


def test_a_uri_with_options_is_left_to_mlflow(cache, tmp_path):
    """SQLAlchemy reads the path of sqlite:///x.db?timeout=20 as x.db: no file named after the URI."""
    tracking.open_store(f"sqlite:///{tmp_path}/mlflow.db?timeout=20")
    tracking.open_store(f"sqlite:///{tmp_path}/a%20b.db")
    assert list(tmp_path.iterdir()) == [tmp_path / "cache"]


def test_a_run_refused_by_its_checks_leaves_no_store_behind(cache, tmp_path):
    """Every command checks its tracking URI before its data and its budget: that check writes
    nothing, so a run that a later check refuses leaves no database in the folder. The store is
    made before the command's first MLflow client (:func:`pipelines.tracking.open_store`)."""
    import dpcore
    from pipelines.config import TrainConfig
    from pipelines.plan import plan_run

    db = tmp_path / "mlflow.db"
    cfg = TrainConfig(lot_size=100_000, storage_path=str(tmp_path / "runs"), tracking_uri=f"sqlite:///{db}")
    with pytest.raises(dpcore.DPConfigError, match="lot_size=100000 is larger than the dataset"):
        plan_run(cfg)  # refused once the data is read, after the tracking URI's check
    assert not db.exists() and (tmp_path / "runs").is_dir()
    tracking.open_store(f"sqlite:///{db}")
    assert db.is_file()
