"""The run's plan: everything decided on the driver, once, before any worker starts.

:func:`plan_run` validates the config, checks the tracking store, prepares (ingests and
verifies) the data, builds and validates the model, calibrates σ from (ε, δ), N, the lot size
and the epochs, and bounds the number of releases the budget allows. Anything that can fail
fails here, before any budget is spent. The result is a :class:`RunPlan`: the workers, the
driver's MLflow logging and a resumed run all read the same typed plan (MLflow keeps it as the
run's ``spec.json`` artifact).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import dpcore

from . import tracking
from .catalog import TEXT_DATASETS
from .config import TrainConfig
from .data.cache_names import cache_digest
from .data.shards import FORMAT_VERSION, data_digest
from .models import build_run_model


@dataclass
class RunPlan:
    """A run as planned on the driver (the workers get exactly this)."""

    config: dict  # the run's TrainConfig, as a dict (YAML keys)
    run_name: str
    ray_run_name: str
    storage_path: str
    run_dir: str
    journal: str  # the ledger's append-only journal: created by the driver, required by rank 0
    data_dir: str  # the ingested, verified dataset
    input_shape: list
    train_data_dir: str  # what the workers train on: cached public features (ScatterNet), else data_dir
    features: str | None
    num_classes: int
    split_info: dict
    dataset_size: int  # N, the training split (all shards)
    noise_multiplier: float  # σ
    sample_rate: float  # q
    event_kind: str  # the privacy event of one step (dpcore.events)
    max_releases: int  # how many steps the budget allows at this σ (≥ steps)
    pca_path: str | None
    audit_path: str | None
    steps: int
    checkpoint_every: int
    epsilon_every: int
    tracking_uri: str
    parameters: int  # trainable parameters
    run_id: str | None = None  # the MLflow run, once it exists
    data_digest: str | None = None  # data_dir's manifest (shards, shape, classes): a resume and the workers check it
    train_data_digest: str | None = None  # train_data_dir's (the features' where a public front end is cached)
    memory_share: float = 1.0  # of each node's memory, for the run's workers there (a sweep: 1/trials at once)
    extra: dict = field(default_factory=dict)  # keys of older plans this version does not know

    def to_dict(self) -> dict:
        d = asdict(self)
        return {**d.pop("extra"), **d}

    @classmethod
    def from_dict(cls, d: dict) -> RunPlan:
        known = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in d.items() if k in known}, extra={k: v for k, v in d.items() if k not in known})

    def step_event(self) -> dpcore.PrivacyEvent:
        """The privacy event of one training step (Gaussian or Laplace)."""
        return dpcore.PrivacyEvent.of(self.event_kind, self.noise_multiplier, self.sample_rate)


JOURNAL = "ledger.journal.jsonl"
MAX_PCA_DIM = 8192  # a d×d float64 matrix of 512 MiB


# ------------------------------------------------------------------------------------------
# Planning (driver side, before any worker starts)
def _source_fingerprint(cfg: TrainConfig) -> dict:
    """What the raw data is, cheaply (names, sizes, times and inodes of its files; no reading): the key
    of the ingest cache, so that a cached dataset is re-used without loading the source."""
    from .data import IDX_DATASETS, find_idx_files

    fingerprint = {
        "name": cfg.dataset,
        "format": FORMAT_VERSION,
        "data_dir": cfg.data_dir,
        "image_size": cfg.image_size,
        "generated_size": cfg.generated_size,
        "val_fraction": cfg.val_fraction,
        "test_fraction": cfg.test_fraction,
        "split_seed": cfg.split_seed,
        "train_subset": cfg.train_subset,
    }
    files: list[Path] = []
    if cfg.dataset in IDX_DATASETS and not cfg.download:
        files = [p for pair in find_idx_files(cfg.dataset, cfg.data_dir).values() for p in pair]
    elif cfg.data_dir and cfg.dataset in (
        "imagefolder",
        "cifar10",
        "cifar100",
        *TEXT_DATASETS,
    ):  # trees a user may edit
        root = Path(cfg.data_dir).expanduser()
        files = [f for f in root.rglob("*") if f.is_file()] if root.is_dir() else [root] if root.is_file() else []
    if cfg.dataset in TEXT_DATASETS:  # the tokenizer and the length are part of what is stored
        fingerprint.update(
            model=cfg.model, max_length=cfg.max_length, email_view=cfg.email_view, text_classes=cfg.text_classes
        )
        fingerprint["tokenization"] = 2  # 2: special tokens' text split (2026-11-29); older caches are made again
    # The change time and inode too: an edit that sets the modification time back (cp -p, rsync -t,
    # tar x) keeps size and mtime, and would re-use the cache of the old content (helper-36).
    fingerprint["files"] = sorted(_stat_of(f) for f in files)
    return fingerprint


def _stat_of(f: Path) -> tuple:
    st = f.stat()
    return str(f.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def prepare_data(cfg: TrainConfig) -> tuple[Path, dict]:
    """An ingested, verified dataset for ``cfg``: ``data_dir`` itself if it is one, else the
    dataset loaded and ingested once into ``storage_path/datasets`` (one shard per worker).
    A cached ingest is re-used without loading the source again (its key is the source files'
    names, sizes, times and inodes) while its verification holds."""
    from .data import CorruptShardError, ingest, load_configured, verify

    if cfg.data_dir and (Path(cfg.data_dir).expanduser() / "manifest.json").is_file():
        if cfg.train_subset:
            raise dpcore.DPConfigError(
                f"train_subset={cfg.train_subset} applies when the platform ingests the data itself; {cfg.data_dir} is "
                "already ingested. Point --data-dir to the raw files, or ingest a smaller dataset."
            )
        path = Path(cfg.data_dir).expanduser().resolve()
        return path, verify(path)
    fingerprint = _source_fingerprint(cfg)
    # Keyed (pipelines.data.cache_names): the folder's name is in the plan MLflow keeps.
    key = cache_digest(cfg.storage_path, json.dumps(fingerprint, sort_keys=True, default=str).encode(), 12)
    out = Path(cfg.storage_path).resolve() / "datasets" / f"{cfg.dataset}-{key}-{cfg.num_workers}shards"
    if (out / "manifest.json").is_file():
        try:
            return out, verify(out)
        except CorruptShardError:
            pass  # our own cache: rewrite it
    dataset = load_configured(cfg).with_train_subset(cfg.train_subset)
    ingest(dataset, out, num_shards=cfg.num_workers)
    return out, verify(out)


def prepare_features(cfg: TrainConfig, data_dir: Path, manifest: dict, model) -> tuple[Path, dict] | None:
    """The cached features of the model's public front end (ScatterNet), or None when the model
    has none or the run augments its inputs (then the front end runs at every step)."""
    from .data.features import ensure_features
    from .models import split_public_front

    front, _ = split_public_front(model)
    if front is None or cfg.augmentation_multiplicity > 1:
        return None
    return ensure_features(
        data_dir, manifest, front, front.cache_key(), cfg.storage_path, stream=None if cfg.quiet else sys.stderr
    )


def with_absolute_model(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with a local ``hf:`` model folder as an absolute path (see :func:`pipelines.text.hf.absolute`)."""
    if not cfg.model.startswith("hf:"):
        return cfg
    from .text.hf import absolute

    return dataclasses.replace(cfg, model=absolute(cfg.model))


def check_shards(cfg: TrainConfig, data_dir: Path, manifest: dict) -> None:
    """Each worker reads shards of its own: an ingested dataset needs at least ``num_workers``."""
    if cfg.num_workers > manifest["num_shards"]:
        raise dpcore.DPConfigError(
            f"num_workers={cfg.num_workers} but {data_dir} has {manifest['num_shards']} training shards; "
            f"re-ingest with at least {cfg.num_workers} shards or use fewer workers."
        )


def check_tokenizer(cfg: TrainConfig, data_dir: Path, manifest: dict) -> None:
    """A text dataset's shards hold token ids: the run's model must read them with the tokenizer
    that made them (the logged model tokenizes with the run's). Compared by the manifest's
    fingerprint of that tokenizer, or, for a dataset ingested before it was kept, by name."""
    source = manifest.get("source")
    if not isinstance(source, dict) or "tokenizer" not in source or not cfg.model.startswith("hf:"):
        return
    made_by = source["tokenizer"]
    fix = f"re-ingest {data_dir} with --model {cfg.model}, or train with --model {made_by}"
    if "tokenizer_sha256" in source:
        from .text.hf import load_tokenizer
        from .text.sources import tokenizer_fingerprint

        if tokenizer_fingerprint(load_tokenizer(cfg.model)) != source["tokenizer_sha256"]:
            raise dpcore.DPConfigError(
                f"{data_dir} was tokenized by {made_by}, whose tokenizer is not model={cfg.model!r}'s (other ids, "
                f"special tokens or padding): the model would read other words than the shards hold. {fix[0].upper()}{fix[1:]}."
            )
    elif made_by != cfg.model:
        raise dpcore.DPConfigError(
            f"{data_dir} was tokenized by {made_by} (an ingest that kept no fingerprint of its tokenizer), not by "
            f"model={cfg.model!r}: {fix}."
        )


def plan_run(cfg: TrainConfig, on_checked: Callable[[], None] | None = None) -> RunPlan:
    """Validate everything and plan the run. Raises DPConfigError before anything starts.
    ``on_checked`` is called once the config, the data (every shard) and the model have passed
    their checks, before σ is calibrated: the driver starts its local Ray cluster there."""
    cfg.validate()
    cfg = with_absolute_model(cfg)  # the workers build the model in a working folder of their own
    tracking_uri = tracking.resolve_tracking_uri(cfg.tracking_uri)
    tracking.check_tracking_uri(tracking_uri)
    data_dir, manifest = prepare_data(cfg)
    n = sum(e["rows"] for e in manifest["files"] if e["split"] == "train")
    check_shards(cfg, data_dir, manifest)
    check_tokenizer(cfg, data_dir, manifest)
    input_shape = tuple(manifest["input_shape"])
    if manifest["num_classes"] < 2:
        raise dpcore.DPConfigError(
            f"{data_dir} has {manifest['num_classes']} class(es): a classifier needs two or more (its loss would be 0 "
            "and its accuracy 100 % whatever it learned)."
        )
    prior = []
    if cfg.pca_components:
        d = math.prod(input_shape)
        if d > MAX_PCA_DIM:
            raise dpcore.DPConfigError(
                f"DP-PCA on inputs of dimension {d} would need a {d}×{d} float64 matrix and its eigendecomposition "
                f"on the driver; the limit is {MAX_PCA_DIM}. Resize the images (--image-size) or drop --pca-components."
            )
        dpcore.pca.check_pca_components(cfg.pca_components, d)
        prior = cfg.prior_groups()
    if cfg.augmentation_multiplicity > 1 and len(input_shape) != 3:
        raise dpcore.DPConfigError(
            f"augmentation_multiplicity={cfg.augmentation_multiplicity} crops and flips images, but {cfg.dataset} has "
            f"inputs of shape {input_shape}."
        )
    model = build_run_model(cfg, input_shape, manifest["num_classes"])
    if cfg.model.startswith("hf:") and model.pooling != cfg.pooling:  # 'auto' resolved once, here, from the
        # public model folder: every worker, a resume and the logged model then build the same head
        cfg = dataclasses.replace(cfg, pooling=model.pooling)
    dpcore.validate_model(model)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if cfg.audit_canaries and cfg.audit_kind == "input" and cfg.audit_canaries > n:
        raise dpcore.DPConfigError(
            f"audit_canaries={cfg.audit_canaries} input canaries would outnumber the {n} training examples; the model would "
            f"learn mostly canaries. Use at most {n} (the paper uses m well below N)."
        )
    if cfg.audit_canaries and cfg.audit_kind == "gradient" and cfg.audit_canaries > n_params:
        raise dpcore.DPConfigError(
            f"audit_canaries={cfg.audit_canaries} gradient canaries do not fit: each needs a parameter coordinate of its own "
            f"and model={cfg.model!r} has {n_params} trainable parameters. Use at most {n_params} canaries."
        )
    if on_checked is not None:
        on_checked()
    sigma, q, steps = dpcore.plan(dataset_size=n, prior_groups=prior, **cfg.plan_options())
    event_kind = dpcore.events.POISSON_LAPLACE if cfg.noise == "laplace" else dpcore.events.POISSON_GAUSSIAN
    # How many steps the budget allows at this σ (≥ the planned steps): computed once here, so
    # that the workers' budget check starts from it instead of searching again.
    max_releases = dpcore.max_steps(
        sigma,
        q,
        cfg.target_epsilon,
        cfg.target_delta,
        cfg.accountant,
        prior_groups=prior,
        event=dpcore.PrivacyEvent.of(event_kind, sigma, q),
    )
    features = prepare_features(
        cfg, data_dir, manifest, model
    )  # last: everything that can fail cheaply has been checked
    every = cfg.checkpoint_every or max(1, math.ceil(steps / 10))
    method = "" if cfg.method == "dpsgd" else f"-{cfg.method}"  # a BAM run reads as one in the runs list
    name = cfg.run_name or f"{cfg.dataset}-{tracking.model_label(cfg.model)}{method}-{time.strftime('%Y%m%d-%H%M%S')}"
    ray_run_name = f"{name}-{uuid.uuid4().hex[:6]}"
    storage = Path(cfg.storage_path).resolve()
    run_dir = storage / ray_run_name
    return RunPlan(
        **{
            "config": cfg.to_dict(),
            "run_name": name,
            "ray_run_name": ray_run_name,
            "storage_path": str(storage),
            "run_dir": str(run_dir),
            "journal": str(run_dir / JOURNAL),
            "data_dir": str(data_dir),
            "input_shape": list(manifest["input_shape"]),
            # what the workers train on: the cached features of a public front end (ScatterNet), else the data itself
            "train_data_dir": str(features[0]) if features else str(data_dir),
            "features": features[1]["source"]["features"] if features else None,
            "num_classes": manifest["num_classes"],
            "split_info": manifest.get("split_info", {}),
            "dataset_size": n,
            "noise_multiplier": sigma,
            "sample_rate": q,
            "event_kind": event_kind,
            "max_releases": max_releases,
            "pca_path": str(run_dir / "pca.pt") if cfg.pca_components else None,
            "audit_path": str(run_dir / "audit.pt") if cfg.audit_canaries else None,
            "steps": steps,
            "checkpoint_every": every,
            "epsilon_every": max(1, steps // 20),
            "tracking_uri": tracking_uri,
            "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "data_digest": data_digest(storage, manifest),  # keyed: spec.json is in MLflow
            "train_data_digest": data_digest(storage, features[1] if features else manifest),
        }
    )
