"""Sections shared by the training and the federated configs: the dataset, the one-run audit,
and MLflow tracking."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import dpcore

from ..catalog import DATASETS, EMAIL_VIEWS, MODELS, NEEDS_DATA_DIR, USES_DATA_DIR
from .options import Section, check_choice, check_count, option


@dataclass(frozen=True)
class DatasetOptions(Section):
    SECTION = "data"

    dataset: str = option("digits", f"dataset: {', '.join(DATASETS)}")
    data_dir: str | None = option(
        None,
        "folder holding the dataset: IDX files (mnist, fashion-mnist; flat or torchvision's layout; default: the standard "
        "install path, /usr/share/datasets/<name>), torchvision's layout (cifar), an ImageFolder tree, or an ingested "
        "dataset (has manifest.json)",
    )
    download: bool = option(False, "download the torchvision dataset into data_dir (needs a network)")
    image_size: int | None = option(
        None, "resize ImageFolder images to this square size; the size of 'generated' images (default 8)"
    )
    generated_size: int = option(10_000, "number of examples of the 'generated' dataset")
    val_fraction: float = option(0.1, "fraction of the training data held out for validation (never trained on)")
    test_fraction: float = option(0.2, "fraction held out for testing, for datasets without their own test set")
    split_seed: int = option(0, "seed of the (public, data-independent) split permutation")
    max_length: int = option(
        128, "text datasets: tokens per text (longer texts are truncated; the ingest manifest counts them)"
    )
    email_view: str = option(
        "message",
        "text datasets of e-mails: message (as shipped, headers first) or subject-body (the Subject and the body's text)",
    )
    text_classes: str | None = option(
        None,
        "dataset 'text': the classes in order, comma-separated (neg,pos); public, never read from the labels. A "
        "CSV/Parquet table needs it (a string label is matched by name, an integer label indexes the list); a folder "
        "of class sub-folders takes it (each sub-folder must be in it), else its sub-folder names count as public",
    )

    def check(self) -> None:
        check_dataset(self)
        dpcore.validation.check_positive_int(self.generated_size, "generated_size")
        dpcore.validation.check_positive_int(self.max_length, "max_length")
        check_choice(self, "email_view", EMAIL_VIEWS)
        check_count(self, "split_seed")
        if self.text_classes is not None:
            if self.dataset != "text":
                raise dpcore.DPConfigError(
                    f"text_classes applies to dataset='text' (a CSV/Parquet table or class folders), not to {self.dataset!r}."
                )
            from ..text.sources import parse_classes  # no torch or transformers at import

            parse_classes(self.text_classes)


def check_dataset(cfg) -> None:
    """``cfg.dataset`` exists, and ``cfg.data_dir`` is one it reads."""
    err = dpcore.DPConfigError
    if cfg.dataset not in DATASETS:
        raise err(f"dataset={cfg.dataset!r} is unknown; available: {', '.join(DATASETS)}.")
    if cfg.dataset in NEEDS_DATA_DIR and not cfg.data_dir:
        raise err(
            f"dataset={cfg.dataset!r} needs --data-dir (the folder that holds it); add --download to fetch it there."
        )
    if cfg.data_dir:
        root = Path(os.path.expanduser(cfg.data_dir))
        manifest = root / "manifest.json"
        if manifest.is_file():  # an ingested dataset: it must be the one the run is named after
            try:
                name = json.loads(manifest.read_text()).get("name")
            except (OSError, ValueError):
                name = None  # the driver's verification names the problem
            if name is not None and name != cfg.dataset:
                raise err(
                    f"data_dir={cfg.data_dir!r} is an ingested {name!r} dataset, but dataset={cfg.dataset!r}. "
                    f"Use --dataset {name}, or point --data-dir to {cfg.dataset}'s files."
                )
        elif cfg.dataset not in USES_DATA_DIR:
            raise err(
                f"dataset={cfg.dataset!r} does not read data_dir={cfg.data_dir!r} (it is built in); drop --data-dir, or "
                f"give an ingested {cfg.dataset} dataset (a folder with manifest.json)."
            )


def check_model(cfg) -> None:
    """``cfg.model`` (and its activation, where the config has one) names a model that exists."""
    if not (cfg.model in MODELS[:-2] or (cfg.model.startswith(("tv:", "hf:")) and len(cfg.model) > 3)):
        raise dpcore.DPConfigError(f"model={cfg.model!r} is unknown; available: {', '.join(MODELS)}.")
    if getattr(cfg, "activation", None) is not None:
        from ..models import check_activation

        check_activation(cfg.activation)


@dataclass(frozen=True)
class AuditOptions(Section):
    """The one-run privacy audit (Steinke, Nasr and Jagielski 2023)."""

    SECTION = "audit"

    audit_canaries: int = option(0, "one-run privacy audit: m canaries (0: off)")
    audit_canary_rate: float = option(
        0.5, "probability that each canary is in the training data: 0.5, the one the audit's bound holds for"
    )
    audit_guesses: int | None = option(
        None,
        "guesses r: 'in' for the r/2 highest scores, 'out' for the r/2 lowest, abstain on the rest (fixed before the "
        "run; default min(200, m))",
    )

    def check(self) -> None:
        check_audit_options(self)

    def resolved_audit_guesses(self) -> int:
        return min(200, self.audit_canaries) if self.audit_guesses is None else self.audit_guesses


def check_audit_options(cfg) -> None:
    """The one-run audit's options."""
    err = dpcore.DPConfigError
    m = cfg.audit_canaries
    if isinstance(m, bool) or not isinstance(m, int) or m < 0:
        raise err(f"audit_canaries={m!r} is invalid: it is the number of canaries m ≥ 2, or 0 for no audit.")
    if not m:
        return
    if m < 2:
        raise err(
            f"audit_canaries={m} is too few: the one-run audit guesses on at least 2 canaries (one guess can never "
            "bound ε); give m ≥ 2 (1000 is typical), or 0 for no audit."
        )
    if cfg.audit_canary_rate != 0.5:
        raise err(
            f"audit_canary_rate={cfg.audit_canary_rate!r} is not supported: the one-run bound (Steinke, Nasr, "
            "Jagielski 2023, Theorem 3.1) holds for canaries each included with probability 1/2; use 0.5."
        )
    r = cfg.resolved_audit_guesses()
    if isinstance(r, bool) or not isinstance(r, int) or not (2 <= r <= m):
        raise err(f"audit_guesses={cfg.audit_guesses!r} must be an integer in [2, audit_canaries={m}].")


@dataclass(frozen=True)
class TrackingOptions(Section):
    """Where the run is recorded (MLflow) and what is printed."""

    SECTION = "tracking"

    tracking_uri: str = option(
        "sqlite:///mlflow.db",
        "MLflow tracking URI (default: $MLFLOW_TRACKING_URI, which mlflow.set_tracking_uri also sets, else ./mlflow.db)",
    )
    experiment: str = option("dp-training", "MLflow experiment")
    run_name: str | None = option(None, "MLflow run name (default: dataset-model-time)")
    registered_model: str | None = option(
        None, "name in the MLflow model registry (default: dp-<dataset>-<model>; 'none' to skip)"
    )
    log_model: bool = option(True, "log (and register) the final model; sweeps log only the best trial's")
    quiet: bool = option(False, "no progress output")
