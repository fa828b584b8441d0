"""MLflow: one run per training, with its config, privacy ledger, metrics, plots and model.

What a run holds:

* params: the whole config, plus the plan (σ, q, steps, N);
* tags: ``dp.epsilon`` (spent, from the ledger), ``dp.delta``, ``dp.accountant``,
  ``dp.level=example``, ``dp.sampling=poisson``, ``dp.randomness``, and
  ``dp.method``, ``dp.noise`` (and ``dp.ascent``, ``dp.pca`` when used), and
  ``dp.diagnostics=non-private`` when the diagnostics mode is on (per-step ``diag_*`` metrics);
* metrics per report: ``epsilon``, validation and test accuracy and loss, throughput;
* artifacts: ``config.json``, ``split.json``, ``ledger/ledger.parquet`` plus the MLflow table
  ``ledger/ledger.json`` (viewable in the UI), ``plots/epsilon_vs_step.png``,
  ``plots/accuracy_vs_epsilon.png``, and the model (signature + input example), registered
  with ``dp.epsilon``/``dp.delta`` on its version.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..plan import RunPlan

import contextlib
import json
import os
import re
import socket
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlparse

import dpcore
from dpcore.readout import epsilon_text

# The run's model, logged and registered: a module of its own, re-exported here.
from .models import log_model, log_run_model, model_label, skips_registry, text_model_meta  # noqa: F401


class TrackingError(dpcore.DPConfigError):
    """The MLflow tracking store cannot be used."""


_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/:@\s]*):(?P<pw>[^@/\s]*)@")


def redact(text: str) -> str:
    """``scheme://user:password@host`` → ``scheme://user:***@host``: what is logged or written to
    MLflow never carries a password (pass them through the environment or a password file)."""
    return _URL_PASSWORD.sub(lambda m: f"{m['head']}:***@", text)


def _redact_obj(obj):
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {k: _redact_obj(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_redact_obj(v) for v in obj]
    return obj


def resolve_tracking_uri(uri: str) -> str:
    """Relative sqlite/file paths become absolute, so that workers and the UI find the same store."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str(Path(uri[len("sqlite:///") :]).resolve())
    if "://" not in uri:  # a plain path: MLflow's file store
        return Path(uri).resolve().as_uri()
    return uri


def sqlite_file(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (its options left off, its escapes decoded), or
    None for any other store."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(unquote(uri[len("sqlite:///") :].split("?", 1)[0])).expanduser()


def open_store(uri: str) -> None:
    """Before the first MLflow client of a command, once every check has passed (so that a
    command that fails leaves no new store behind): a SQLite database that does not exist yet
    is made from the cached schema (:mod:`.sqlite_schema`), not by MLflow's 68 migrations. A URI
    with options or escapes, and any other store, are left to MLflow."""
    db = sqlite_file(uri)
    if db is not None and "?" not in uri and "%" not in uri:
        from .sqlite_schema import create_if_missing

        create_if_missing(db)


def check_tracking_uri(uri: str, timeout: float = 5.0) -> None:
    """Fail fast, with the fix, if the tracking store is unreachable or unwritable. Writes
    nothing (a new SQLite store is made by :func:`open_store`, once the command's checks pass)."""
    parsed = urlparse(uri)
    if parsed.scheme in ("http", "https"):
        url = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                if r.status != 200:
                    raise OSError(f"HTTP {r.status}")
        except (TimeoutError, urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise TrackingError(
                f"the MLflow tracking server {redact(uri)} is unreachable ({reason}). Start it (dp-platform ui, or "
                "mlflow server), fix --tracking-uri, or use the default sqlite:///mlflow.db."
            ) from None
        # a server with basic auth: the credentials come from MLFLOW_TRACKING_USERNAME/PASSWORD
        req = urllib.request.Request(uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1")
        user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
        if os.environ.get("MLFLOW_TRACKING_TOKEN"):
            user = "token"
            req.add_header("Authorization", f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}")
        elif user and password:
            import base64

            req.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
        try:
            urllib.request.urlopen(req, timeout=timeout).close()
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):
                who = f"as {user!r}" if user else "without credentials"
                raise TrackingError(
                    f"the MLflow tracking server {redact(uri)} refused the request {who} (HTTP {e.code}). Set MLFLOW_TRACKING_USERNAME "
                    "and MLFLOW_TRACKING_PASSWORD (never in the URI); for the local stack they are in its credentials.env."
                ) from None
        except (TimeoutError, urllib.error.URLError, OSError):
            pass  # reachable a moment ago; MLflow's own client reports anything else
    elif parsed.scheme == "sqlite":
        path = Path(uri[len("sqlite:///") :])
        parent = path.parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise TrackingError(f"cannot write the MLflow database {path}: {parent} does not exist or is not writable.")
    elif parsed.scheme == "file":
        path = Path(parsed.path)
        existing = next(p for p in [path, *path.parents] if p.exists())
        if not os.access(existing, os.W_OK):
            raise TrackingError(f"cannot write the MLflow file store {path}: {existing} is not writable.")
    elif parsed.scheme in ("postgresql", "mysql", "mssql") or parsed.scheme.startswith(("postgresql+", "mysql+")):
        host, port = (
            parsed.hostname or "localhost",
            parsed.port or {"postgresql": 5432, "mysql": 3306}.get(parsed.scheme.split("+")[0], 1433),
        )
        try:
            socket.create_connection((host, port), timeout=timeout).close()
        except OSError as e:
            raise TrackingError(
                f"the MLflow database {host}:{port} of {parsed.scheme} is unreachable ({e}); fix --tracking-uri."
            ) from None


def dp_tags(cfg, plan: RunPlan) -> dict[str, str]:
    tags = {
        "dp.delta": f"{cfg.target_delta:g}",
        "dp.target_epsilon": f"{cfg.target_epsilon:g}",
        "dp.accountant": cfg.accountant,
        "dp.level": "example",
        "dp.sampling": "poisson",
        "dp.neighbouring": "add/remove one example",
        "dp.randomness": "secure" if cfg.seed is None else f"seeded (seed={cfg.seed}; not for production)",
        "dp.noise_multiplier": f"{plan.noise_multiplier:.6g}",
        "dp.sample_rate": f"{plan.sample_rate:.6g}",
        "dp.run_dir": plan.run_dir,
        "dp.ray_run_name": plan.ray_run_name,
        "dp.guarantee": "covers the training split only; validation/test splits, initial weights and hyperparameter "
        "selection are not covered",
        "dp.method": cfg.method + (f"-{cfg.bam_variant}" if cfg.method == "bam" else ""),
        "dp.noise": f"{cfg.noise} ({cfg.clip_norm_type} clipping)",
    }
    if cfg.method != "dpsgd":
        tags["dp.ascent"] = f"{cfg.resolved_ascent():g} ({cfg.ascent_schedule})"
    if cfg.pca_components:
        tags["dp.pca"] = (
            f"k={cfg.pca_components}, σ={cfg.pca_noise_multiplier:g}, q={cfg.pca_sample_rate:g} (ledgered at step 0)"
        )
    if cfg.diagnostics:
        tags["dp.diagnostics"] = "non-private"
    if plan.dataset_size and cfg.target_delta >= 1.0 / plan.dataset_size:
        tags["dp.warning"] = (
            f"δ={cfg.target_delta:g} is ≥ 1/N = 1/{plan.dataset_size}: a mechanism that publishes a random training "
            "example verbatim meets this δ, so the guarantee is weak"
        )
    return tags


def params_of(cfg, plan: RunPlan) -> dict[str, str]:
    params = {k: ("None" if v is None else redact(str(v))) for k, v in cfg.to_dict().items()}
    params.update(
        {
            "plan.noise_multiplier": f"{plan.noise_multiplier:.8g}",
            "plan.noise_multiplier_source": "given" if cfg.noise_multiplier is not None else "calibrated to (ε, δ)",
            "plan.sample_rate": f"{plan.sample_rate:.8g}",
            "plan.steps": str(plan.steps),
            "plan.dataset_size": str(plan.dataset_size),
            "plan.checkpoint_every": str(plan.checkpoint_every),
        }
    )
    return params


@contextlib.contextmanager
def mlflow_run(
    client,
    *,
    experiment: str,
    run_name: str | None = None,
    tags: dict | None = None,
    parent_run_id: str | None = None,
    run_id: str | None = None,
    find: str | None = None,
    on_failure: Callable[[str], None] | None = None,
):
    """One MLflow run's lifecycle, the same for a training run, a federated run and a sweep's
    parent run: create it in ``experiment`` (or continue ``run_id``, or the first run that the
    filter ``find`` matches), yield its id, and on the way out mark it FINISHED, or FAILED after
    ``on_failure(run_id)`` has recorded what it can (the ledger of what was released: the
    releases that happened are part of the record even when the run failed)."""
    created = False
    if run_id is None:
        exp_id = ensure_experiment(client, experiment)
        found = client.search_runs([exp_id], filter_string=find, max_results=1) if find else []
        if found:
            run_id = found[0].info.run_id
        else:
            parent = {"mlflow.parentRunId": parent_run_id} if parent_run_id else {}
            run_id = client.create_run(exp_id, run_name=run_name, tags={**(tags or {}), **parent}).info.run_id
            created = True
    status = "FAILED"
    try:
        if not created:  # a run continued: running again, with the caller's tags
            client.update_run(run_id, status="RUNNING")
            for k, v in (tags or {}).items():
                client.set_tag(run_id, k, v)
        yield run_id
        status = "FINISHED"
    finally:
        if status != "FINISHED" and on_failure is not None:
            with contextlib.suppress(Exception):
                on_failure(run_id)
        client.set_terminated(run_id, status=status)


# The experiment's kind for the API and for MLflow UIs that read it. MLflow 3.17's UI ignores it
# and takes the kind from its GenAI / Model-training switch, which a link sets with UI_VIEW.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
UI_VIEW = "?workflowType=machine_learning"


def ui_link(base: str, experiment_id: str, run_id: str | None = None) -> str:
    """The UI page of an experiment (its runs table) or of one run, opened in MLflow 3's
    model-training view: a plain link opens the GenAI overview ("No data available")."""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}" + (f"/runs/{run_id}" if run_id else "") + UI_VIEW


def ensure_experiment(client, name: str) -> str:
    """The id of experiment ``name``, created if needed, marked as a model-training experiment
    so that the UI opens on its runs table (a kind set by someone else is left as it is)."""
    exp = client.get_experiment_by_name(name)
    if exp is None:
        return client.create_experiment(name, tags=EXPERIMENT_KIND)
    if "mlflow.experimentKind" not in exp.tags:
        for k, v in EXPERIMENT_KIND.items():
            client.set_experiment_tag(exp.experiment_id, k, v)
    return exp.experiment_id


def describe_run(
    client, run_id: str, name: str, epsilon: float, delta: float, accountant: str, accuracy: float | None
) -> None:
    """What the UI shows without a click. The run's name in the runs list starts with ε and
    test accuracy (``ε=1.99 · 93.1% · <name>``: the list shows no metric columns until a user
    picks them, and cuts names after about 17 characters). Its description, the first thing
    its page shows: ε rounded for reading (the full value stays in the ``epsilon`` metrics and
    the ``dp.epsilon`` tag), δ and test accuracy."""
    shown = epsilon_text(epsilon, ".2f")  # rounded up: never below the ledger's ε
    text = f"**ε = {shown}** at δ = {delta:g} ({accountant})"
    title = f"ε={shown}"
    if accuracy is not None and accuracy == accuracy:  # not NaN
        text += f" · test accuracy **{accuracy:.2%}**"
        title += f" · {accuracy:.1%}"
    client.set_tag(run_id, "mlflow.note.content", text)
    client.set_tag(run_id, "dp.epsilon_rounded", shown)
    client.update_run(run_id, name=f"{title} · {name}")


def record_released(client, run_id: str, ledger: dpcore.PrivacyLedger) -> None:
    """The ε tag and the ledger of whatever was released (for a run that stops early)."""
    if len(ledger):
        client.set_tag(run_id, "dp.epsilon", epsilon_text(ledger.epsilon()))
        log_ledger(client, run_id, ledger)


def ledger_table(ledger: dpcore.PrivacyLedger):
    import pyarrow as pa

    return pa.table(ledger.to_columns())


def log_ledger(client, run_id: str, ledger: dpcore.PrivacyLedger) -> None:
    """The ledger twice: ``ledger/ledger.parquet``, every release (the raw record, for tools
    and ``dp-platform ledger``), and ``ledger/ledger.json``, the table the UI shows: one row
    per run of identical releases (count, first and last step, q, σ, C, status, ε after)."""
    import pyarrow.parquet as pq

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ledger.parquet"
        pq.write_table(ledger_table(ledger), path)
        client.log_artifact(run_id, str(path), artifact_path="ledger")
    runs = ledger.runs()
    table = {k: [r[k] for r in runs] for k in (runs[0] if runs else {"kind": None})}
    client.log_table(run_id, data=table, artifact_file="ledger/ledger.json")


def write_json_artifact(client, run_id: str, name: str, obj, artifact_path: str | None = None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_text(json.dumps(_redact_obj(obj), indent=2, default=str))
        client.log_artifact(run_id, str(path), artifact_path=artifact_path)


def read_json_artifact(tracking_uri: str, run_id: str, artifact_path: str):
    """A run's JSON artifact, parsed; the download goes to a temporary folder that is removed
    (MLflow's own default is a fresh folder under /tmp, left behind on every call)."""
    import mlflow

    with tempfile.TemporaryDirectory() as tmp:
        path = mlflow.artifacts.download_artifacts(
            run_id=run_id, artifact_path=artifact_path, tracking_uri=tracking_uri, dst_path=tmp
        )
        return json.loads(Path(path).read_text())


def log_audit(client, run_id: str, audit: dict, epsilon: float) -> None:
    """The one-run audit beside the ledger's ε: metrics ``audit.epsilon_lower_bound``,
    ``audit.canaries``, ``audit.guesses``, ``audit.correct``; tags saying what was run and
    whether ε_lb ≤ ε held; the canaries (coordinates, membership, scores) as an artifact."""
    from mlflow.entities import Metric

    ts = int(time.time() * 1000)
    metrics = {k: float(audit[k]) for k in ("epsilon_lower_bound", "canaries", "guesses", "correct")}
    client.log_batch(run_id, metrics=[Metric(f"audit.{k}", v, ts, 0) for k, v in metrics.items()])
    kind = (
        "white-box gradient canaries"
        if audit.get("kind", "gradient") == "gradient"
        else "black-box input canaries (out-of-distribution, random labels), scored by loss"
    )
    client.set_tag(run_id, "audit.method", f"one training run, {kind} (Steinke, Nasr, Jagielski 2023)")
    client.set_tag(run_id, "audit.confidence", f"{audit['confidence']:g}")
    ok = audit["epsilon_lower_bound"] <= epsilon
    client.set_tag(
        run_id, "audit.check", "ε_lb ≤ ε" if ok else "FAILED: ε_lb > ε (a bug, or a 1-in-20 chance at 95 % confidence)"
    )
    write_json_artifact(
        client,
        run_id,
        "canaries.json",
        {
            "coordinates": audit["coords"].tolist(),
            "included": audit["membership"].tolist(),
            "scores": audit["scores"].tolist(),
            "guesses": audit["guesses"],
            "correct": audit["correct"],
            "epsilon_lower_bound": audit["epsilon_lower_bound"],
            "epsilon": epsilon,
        },
        artifact_path="audit",
    )
