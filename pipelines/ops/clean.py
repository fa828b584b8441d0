"""``dp-platform clean``: remove what runs left on this machine, after saying what and asking.

What a run leaves, and where:

* ``dp_runs/`` (or ``$DP_STORAGE_PATH``, or ``--storage-path``): each run's folder with its
  checkpoints and ledger journal, and ingested dataset caches;
* the local MLflow store: ``mlflow.db`` (or the file of ``$MLFLOW_TRACKING_URI`` when it is
  ``sqlite:///...``) and the artifacts beside it, ``mlruns/`` (models, ledgers, plots);
* ``~/.cache/dp-platform`` (or ``$XDG_CACHE_HOME/dp-platform``): the record of verified
  shards and the compiled per-example kernel;
* a sweep's local Optuna store, ``optuna.db`` (or the file of ``$DP_OPTUNA_STORAGE`` when it is
  ``sqlite:///...``): every trial's exact scores.

A tracking server (``http://...``) or a PostgreSQL store is never touched: its runs are the
server's (``dp-platform stack down --purge`` removes the local stack's). A run that is still
training (its ledger journal is locked) stops the clean-up before anything is deleted.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from ..config.options import Parser
from ..tracking import sqlite_file as _sqlite_file

PROG = "dp-platform clean"


def _size(path: Path) -> int:
    if path.is_file() or path.is_symlink():
        return path.lstat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += (Path(root) / f).lstat().st_size
            except OSError:
                pass
    return total


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def cache_dir() -> Path:
    from dpcore.native_build import user_cache

    return user_cache()


def tracking_files(tracking_uri: str) -> list[Path]:
    """The local MLflow store of ``tracking_uri``: the SQLite file and the ``mlruns/`` folder
    beside it (MLflow's default artifact location for a local store). Nothing for a server."""
    return [p for db in sqlite_file(tracking_uri) for p in (db, db.parent / "mlruns")]


def sqlite_file(uri: str) -> list[Path]:
    """The file of a ``sqlite:///`` URL (an Optuna store), or nothing for a server's."""
    db = _sqlite_file(uri)
    return [] if db is None else [db.resolve()]


def targets(storage_path: str, tracking_uri: str, what: set[str], optuna_storage: str = "") -> list[tuple[str, Path]]:
    """(label, path) of everything that exists and would be removed."""
    found: list[tuple[str, Path]] = []
    if "runs" in what:
        found.append(("runs: checkpoints, ledger journals, dataset caches", Path(storage_path).expanduser().resolve()))
    if "tracking" in what:
        found += [("MLflow store: runs, metrics, models", p) for p in tracking_files(tracking_uri)]
    if "cache" in what:
        found.append(("cache: verified shards, compiled kernel, MLflow's empty schema", cache_dir()))
    if "sweeps" in what:
        found += [("Optuna store: every sweep trial's exact scores", p) for p in sqlite_file(optuna_storage)]
    return [(label, p) for label, p in found if p.exists() or p.is_symlink()]


def training_now(storage: Path) -> list[Path]:
    """Ledger journals under ``storage`` that a worker holds locked: a run is training there."""
    if not storage.is_dir():
        return []
    from ..train.run_ledger import journal_is_locked

    return [p for p in storage.rglob("*.lock") if journal_is_locked(str(p)[: -len(".lock")])]


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    p = Parser(
        prog=prog,
        description="Remove what runs left on this machine: dp_runs/ (checkpoints, ledger journals, dataset caches), "
        "the local MLflow store (mlflow.db and mlruns/), ~/.cache/dp-platform and the sweeps' local Optuna store "
        "(optuna.db). Lists what it would remove and asks first. A tracking server or PostgreSQL store is never touched.",
    )
    p.add_argument("--yes", "-y", action="store_true", help="do not ask; remove at once")
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p.add_argument("--runs", action="store_true", help="only the run folders (storage path)")
    p.add_argument("--tracking", action="store_true", help="only the local MLflow store")
    p.add_argument("--cache", action="store_true", help="only ~/.cache/dp-platform")
    p.add_argument("--sweeps", action="store_true", help="only the sweeps' local Optuna store (optuna.db)")
    p.add_argument(
        "--storage-path",
        default=os.environ.get("DP_STORAGE_PATH") or "dp_runs",
        help="the runs' storage path (default: $DP_STORAGE_PATH, else ./dp_runs)",
    )
    p.add_argument(
        "--tracking-uri",
        default=os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db",
        help="the MLflow store (default: $MLFLOW_TRACKING_URI, else ./mlflow.db); only a sqlite:/// store is removed",
    )
    p.add_argument(
        "--optuna-storage",
        default=os.environ.get("DP_OPTUNA_STORAGE") or "sqlite:///optuna.db",
        help="the sweeps' Optuna store (default: $DP_OPTUNA_STORAGE, else ./optuna.db); only a sqlite:/// store is removed",
    )
    a = p.parse_args(argv)
    kinds = ("runs", "tracking", "cache", "sweeps")
    what = {k for k in kinds if getattr(a, k)} or set(kinds)
    found = targets(a.storage_path, a.tracking_uri, what, a.optuna_storage)
    if not found:
        print("nothing to clean: no run folders, local MLflow store, cache or Optuna store here.")
        return 0
    busy = training_now(Path(a.storage_path).expanduser().resolve()) if "runs" in what else []
    if busy:
        print(
            f"error: a run is still training (its ledger journal {busy[0].with_suffix('')} is locked); stop it first. "
            "Nothing was removed.",
            file=sys.stderr,
        )
        return 1
    print("--dry-run: this would remove (nothing is removed):" if a.dry_run else "This removes:")
    for label, path in found:
        print(f"  {path}  ({_human(_size(path))}; {label})")
    if a.dry_run:
        return 0
    if not a.yes:
        if not sys.stdin.isatty():
            print(
                "error: not a terminal, so nothing was asked and nothing removed; add --yes to remove.", file=sys.stderr
            )
            return 1
        if input("Remove them? [y/N] ").strip().lower() not in ("y", "yes"):
            print("nothing removed.")
            return 0
    for _, path in found:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    print(f"removed {len(found)} item(s).")
    return 0
