"""dp-platform: one command for the platform.

dp-platform train [CONFIG.yaml] [--flags]     train with DP on Ray; ledger and model to MLflow
dp-platform sweep [CONFIG.yaml] [--flags]     Optuna sweep at a fixed (ε, δ); trials on Ray, runs in MLflow
dp-platform federated [CONFIG.yaml] [--flags] client-level DP federated averaging on Ray actors
dp-platform audit [CONFIG.yaml] [--flags]     privacy audit: one training run with canaries, or --mechanism
dp-platform ingest DATASET OUT_DIR            write a dataset once as Arrow shards (checksummed)
dp-platform ledger RUN_ID                     print a run's privacy ledger from MLflow
dp-platform ui                                the MLflow UI on 127.0.0.1, on the same store
dp-platform bench                             private step time and memory, beside Opacus
dp-platform stack up|add-node|status|down     PostgreSQL, MLflow (basic auth), a Ray head (token auth), on loopback
dp-platform submit [--sweep] CONFIG [-- ARGS] a training run or a sweep as a Ray job; follows its logs
dp-platform status [JOB_ID]                   a job's status (with the reason when it failed), or all jobs
dp-platform logs JOB_ID [--follow]            a job's logs
dp-platform stop JOB_ID                       stop a job
dp-platform clean [--yes]                     remove dp_runs/, the local mlflow.db and mlruns/, ~/.cache/dp-platform (asks first)
dp-platform --version                         the installed version
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import dpcore
from dpcore.readout import epsilon_text

from ._trace import trace
from .config.options import Parser

PROG = "dp-platform"


def _ingest(argv: list[str]) -> int:
    import time

    from .catalog import DATASETS

    p = Parser(
        prog=f"{PROG} ingest",
        description="Write a dataset once as Arrow shards (images in their own dtype, labels, split) with a checksummed "
        "manifest; train on it with --data-dir OUT_DIR. With --verify, re-check an ingested dataset in full instead.",
    )
    p.add_argument("dataset", help=f"one of {', '.join(DATASETS)}; with --verify, the ingested folder to check")
    p.add_argument("out_dir", nargs="?", help="folder to write (manifest.json, train-*.arrow, val.arrow, test.arrow)")
    p.add_argument(
        "--verify", action="store_true", help="re-hash every file of the ingested folder DATASET against its manifest"
    )
    p.add_argument(
        "--num-shards", type=int, default=2, help="training shards; use a multiple of the number of workers (default 2)"
    )
    p.add_argument(
        "--data-dir", help="where the raw dataset is (IDX files, torchvision's layout or an ImageFolder tree)"
    )
    p.add_argument("--download", action="store_true", help="download the torchvision dataset into --data-dir")
    p.add_argument(
        "--image-size", type=int, help="resize ImageFolder images (or size generated ones) to this square size"
    )
    p.add_argument("--generated-size", type=int, default=10_000, help="examples of the 'generated' dataset")
    p.add_argument(
        "--generated-channels", type=int, default=1, help="channels of the 'generated' images (with --image-size)"
    )
    p.add_argument(
        "--val-fraction", type=float, default=0.1, help="validation fraction carved out of the training data"
    )
    p.add_argument("--test-fraction", type=float, default=0.2, help="test fraction, for datasets without a test set")
    p.add_argument("--split-seed", type=int, default=0, help="seed of the public split permutation")
    p.add_argument(
        "--model", default="", help="text datasets: the hf:<folder or hub name> whose tokenizer runs at ingest"
    )
    p.add_argument("--max-length", type=int, default=128, help="text datasets: tokens per text (longer are truncated)")
    p.add_argument(
        "--email-view", default="message", help="text datasets of e-mails: message (as shipped) or subject-body"
    )
    p.add_argument(
        "--text-classes",
        help="text: the public class list, in order, comma-separated (neg,pos); needed for a CSV/Parquet table",
    )
    a = p.parse_args(argv)
    from .config import load_config  # torch and pyarrow: after the flags are parsed
    from .data import CorruptShardError, ingest, load_dataset, verify
    from .data.sources import SOURCE_OPTIONS

    t0 = time.monotonic()
    try:
        if a.verify:
            manifest = verify(a.dataset, full=True)
            rows = sum(e["rows"] for e in manifest["files"])
            size = sum(e.get("bytes", 0) for e in manifest["files"])
            print(
                f"ok: {a.dataset}: {len(manifest['files'])} files, {rows} rows, {size / 2**20:.1f} MiB, every SHA-256 "
                f"matches ({time.monotonic() - t0:.1f}s)"
            )
            return 0
        if a.out_dir is None:
            p.error("OUT_DIR is required (or --verify FOLDER)")
        given = {k: getattr(a, k) for k in ("model", "max_length", "email_view", "text_classes")}
        load_config(
            overrides={"dataset": a.dataset, "data_dir": a.data_dir, **{k: v for k, v in given.items() if v}}
        ).validate()
        ds = load_dataset(
            a.dataset,
            model=a.model,
            generated_channels=a.generated_channels,
            **{k: getattr(a, k) for k in SOURCE_OPTIONS},
        )
        t1 = time.monotonic()
        out = ingest(ds, a.out_dir, num_shards=a.num_shards)
    except CorruptShardError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except dpcore.DPError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = sum(f.stat().st_size for f in Path(out).glob("*.arrow"))
    print(
        f"wrote {ds.name}: {len(ds.train)} train rows in {a.num_shards} shards, {len(ds.val)} val, {len(ds.test)} test "
        f"({ds.train.x.dtype}, {size / 2**20:.1f} MiB) -> {out}  (load {t1 - t0:.1f}s, write and hash {time.monotonic() - t1:.1f}s)"
    )
    return 0


def fetch_ledger(run_id: str, tracking_uri: str):
    """A run's ledger table (pyarrow) from its MLflow artifacts."""
    import tempfile

    import mlflow
    import pyarrow.parquet as pq

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    with tempfile.TemporaryDirectory(prefix="dp-ledger-") as tmp:  # nothing left behind in /tmp
        path = mlflow.artifacts.download_artifacts(
            run_id=run_id, artifact_path="ledger/ledger.parquet", tracking_uri=tracking_uri, dst_path=tmp
        )
        return pq.read_table(path).combine_chunks()


def find_run(client, run_id: str):
    """The run ``run_id`` names: its full id, or a prefix of it (8 characters, as MLflow's UI
    shows) that exactly one run of the store starts with. Raises ``LookupError`` with the reason."""
    import mlflow

    try:
        return client.get_run(run_id)
    except mlflow.exceptions.MlflowException as e:
        reason = e.message.splitlines()[0]
    if len(run_id) < 32 and run_id.isascii() and run_id.isalnum():  # nothing to quote in the filter
        view, like = mlflow.entities.ViewType.ALL, f"attributes.run_id LIKE '{run_id.lower()}%'"
        hits, token = [], None
        try:
            while len(hits) < 6:  # every page of experiments (a store may hold more than one page)
                page = client.search_experiments(view_type=view, max_results=1000, page_token=token)
                ids = [x.experiment_id for x in page]
                if ids:
                    hits += client.search_runs(ids, filter_string=like, run_view_type=view, max_results=6)
                token = page.token
                if not token:
                    break
        except mlflow.exceptions.MlflowException as e:
            raise LookupError(
                f"{reason}; searching for runs that start with {run_id!r} failed too: {e.message.splitlines()[0]}"
            ) from None
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            names = ", ".join(f"{r.info.run_id} ({r.info.run_name})" for r in hits[:5])
            more = " …" if len(hits) > 5 else ""
            raise LookupError(f"several runs start with {run_id!r}: {names}{more}; give more of the id")
        reason = f"no run id starts with {run_id!r}"
    raise LookupError(reason)


def _ledger(argv: list[str]) -> int:
    p = Parser(
        prog=f"{PROG} ledger",
        description="Print a run's privacy ledger (every noisy release, with the cumulative ε) from MLflow.",
    )
    p.add_argument("run_id", help="MLflow run id (printed by train), or its first characters (8 are shown in the UI)")
    p.add_argument(
        "--tracking-uri",
        default=os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db",
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else ./mlflow.db)",
    )
    p.add_argument("--all", action="store_true", help="print every entry (default: the first and last 10)")
    p.add_argument("--csv", action="store_true", help="print CSV instead of a table")
    a = p.parse_args(argv)
    import mlflow

    from .tracking import resolve_tracking_uri, sqlite_file

    uri = resolve_tracking_uri(a.tracking_uri)
    db = sqlite_file(uri)
    if db is not None and not db.is_file():
        # MLflow would make an empty store there: a command that only reads makes nothing
        print(
            f"error: no MLflow store at {db}: give --tracking-uri (or $MLFLOW_TRACKING_URI), "
            "or run from the folder you trained in.",
            file=sys.stderr,
        )
        return 2
    try:
        run = find_run(mlflow.MlflowClient(uri), a.run_id)
    except LookupError as e:
        print(f"error: no run {a.run_id} in {uri}: {e}", file=sys.stderr)
        return 2
    a.run_id = run.info.run_id
    try:
        table = fetch_ledger(a.run_id, uri)
    except mlflow.exceptions.MlflowException as e:
        study = run.data.tags.get("sweep.study")
        why = (
            f"it is the parent run of sweep {study!r}; each trial's run has its own ledger (the parent's child runs)"
            if study and "optuna.trial_number" not in run.data.tags
            else e.message.splitlines()[0]
        )
        print(f"error: no ledger for run {a.run_id} in {uri}: {why}", file=sys.stderr)
        return 2
    rows = table.to_pylist()
    if a.csv:
        print(",".join(table.column_names))
        for r in rows:
            print(",".join("" if v is None else str(v) for v in r.values()))
        return 0
    tags = run.data.tags
    print(f"run {a.run_id} ({run.info.run_name}, {run.info.status})")
    print(
        f"ε spent: {tags.get('dp.epsilon', '?')} of budget {tags.get('dp.target_epsilon', '?')} at δ={tags.get('dp.delta', '?')} "
        f"({tags.get('dp.accountant', '?')}; {tags.get('dp.level', '?')}-level, {tags.get('dp.sampling', '?')} sampling)"
    )
    committed = sum(r["status"] == "committed" for r in rows)
    replayed = sum(bool(r.get("replayed")) for r in rows)
    again = f" ({replayed} replayed after a restart, released once)" if replayed else ""
    print(f"{len(rows)} releases: {committed} committed{again}, {len(rows) - committed} rolled back (counted)")
    head = f"{'#':>5} {'step':>6} {'kind':<17} {'q':>8} {'σ':>8} {'C':>6} {'status':<20} {'ε':>8}"
    print(head)
    print("-" * len(head))
    show = rows if a.all or len(rows) <= 20 else rows[:10] + [None] + rows[-10:]
    for r in show:
        if r is None:
            print(f"{'…':>5}")
            continue
        eps = "" if r["epsilon"] is None or math.isnan(r["epsilon"]) else epsilon_text(r["epsilon"], ".4f")
        print(
            f"{r['index']:>5} {r['step']:>6} {r['kind']:<17} {r['sample_rate']:>8.4f} {r['noise_multiplier']:>8.4f} "
            f"{r['clip_norm']:>6.3g} {r['status'] + (' (replayed)' if r.get('replayed') else ''):<20} {eps:>8}"
        )
    if any(r is not None and (r["epsilon"] is None or math.isnan(r["epsilon"])) for r in show):
        print("(a blank ε: not composed at that release; the budget check before it was exact. ε spent is above.)")
    return 0


# command: (module, its entry point, whether it takes ``prog``); imported only when the command runs
_LAZY_COMMANDS = {
    "train": ("pipelines.train", "main", True),
    "sweep": ("tuning.cli", "main", True),
    "audit": ("pipelines.audit.cli", "main", True),
    "federated": ("pipelines.federated.cli", "main", True),
    "stack": ("pipelines.ops.stack", "main", False),
    "status": ("pipelines.ops.jobs", "main_status", True),
    "logs": ("pipelines.ops.jobs", "main_logs", True),
    "stop": ("pipelines.ops.jobs", "main_stop", True),
    "ui": ("pipelines.ops.ui", "main", True),
    "clean": ("pipelines.ops.clean", "main", True),
    "bench": ("pipelines.ops.bench_cli", "main", False),
}


def main(argv: list[str] | None = None) -> int:
    trace("cli main")
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"ingest": _ingest, "ledger": _ledger, "submit": None, **dict.fromkeys(_LAZY_COMMANDS)}
    if argv and argv[0] == "--version":
        from importlib.metadata import version

        print(f"dp-platform {version('dp-platform')}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(__doc__.strip())
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nerror: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    try:
        return _run_command(commands, argv[0], argv[1:])
    except BrokenPipeError:  # `dp-platform ledger RUN | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _run_command(commands: dict, cmd: str, rest: list[str]) -> int:
    if cmd == "submit":  # the CLI composes pipelines and tuning: a sweep's config is checked by tuning
        from tuning.cli import check_args

        from .ops import jobs

        return jobs.main_submit(rest, prog=f"{PROG} submit", sweep_checker=check_args)
    if cmd in _LAZY_COMMANDS:  # imported only when run: `dp-platform --help` stays fast
        import importlib

        module, function, takes_prog = _LAZY_COMMANDS[cmd]
        main_of = getattr(importlib.import_module(module), function)
        return main_of(rest, prog=f"{PROG} {cmd}") if takes_prog else main_of(rest)
    return commands[cmd](rest)


if __name__ == "__main__":
    sys.exit(main())
