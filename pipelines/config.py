"""One frozen config object describes a training run. YAML files and CLI flags only fill it in.

    cfg = load_config("run.yaml", overrides={"lr": 0.1})      # YAML, then flags
    cfg = TrainConfig(dataset="mnist", data_dir="~/data")      # or directly

Every field has a help text; the CLI's ``--help`` is generated from them. :meth:`TrainConfig.validate`
checks everything that can be checked without data (the dataset, the model and the budget are
checked by the driver before any worker starts).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dpcore

from .data import DATASETS, NEEDS_DATA_DIR, USES_DATA_DIR
from .models import MODELS, check_activation

OPTIMIZERS = ("sgd", "adam", "nadam")


def _f(default, help: str, group: str = "training"):
    return field(default=default, metadata={"help": help, "group": group})


@dataclass(frozen=True)
class TrainConfig:
    # data
    dataset: str = _f("digits", f"dataset: {', '.join(DATASETS)}", "data")
    data_dir: str | None = _f(
        None,
        "folder holding the dataset: IDX files (mnist, fashion-mnist; flat or torchvision's layout; default: the standard "
        "install path, /usr/share/datasets/<name>), torchvision's layout (cifar), an ImageFolder tree, or an ingested "
        "dataset (has manifest.json)",
        "data",
    )
    download: bool = _f(False, "download the torchvision dataset into data_dir (needs a network)", "data")
    image_size: int | None = _f(
        None, "resize ImageFolder images to this square size; the size of 'generated' images (default 8)", "data"
    )
    generated_size: int = _f(10_000, "number of examples of the 'generated' dataset", "data")
    val_fraction: float = _f(0.1, "fraction of the training data held out for validation (never trained on)", "data")
    test_fraction: float = _f(0.2, "fraction held out for testing, for datasets without their own test set", "data")
    split_seed: int = _f(0, "seed of the (public, data-independent) split permutation", "data")
    train_subset: int = _f(
        0,
        "train on the first K examples of the publicly shuffled training split only (0: all); validation and test are unchanged",
        "data",
    )
    # model and optimiser
    model: str = _f("mlp", f"model: {', '.join(MODELS)}", "model")
    replace_batchnorm: bool = _f(False, "replace BatchNorm layers by GroupNorm (needed for most tv: models)", "model")
    activation: str | None = _f(
        None,
        "activation of mlp, small_cnn, cnn, scatter_cnn: relu, tanh, elu, or tempered:s,T,o (Papernot et al.'s "
        "tempered sigmoid s·sigmoid(T·x)−o). Default: the model's own (relu; tanh for small_cnn and scatter_cnn)",
        "model",
    )
    groupnorm: bool = _f(False, "GroupNorm after each convolution of small_cnn and cnn", "model")
    weight_standardization: bool = _f(
        False, "weight-standardised convolutions in small_cnn and cnn (De et al. 2022)", "model"
    )
    optimizer: str = _f("adam", f"optimizer applied to the noised gradient: {', '.join(OPTIMIZERS)}", "model")
    lr: float = _f(0.02, "learning rate", "model")
    momentum: float = _f(0.9, "momentum (sgd only)", "model")
    init_seed: int = _f(0, "seed of the model's initial weights (public, identical on every worker)", "model")
    # privacy
    lot_size: int = _f(512, "expected lot size L; the Poisson rate is q = L/N", "privacy")
    epochs: float = _f(60.0, "passes over the data; steps = round(epochs/q)", "privacy")
    target_epsilon: float = _f(2.0, "privacy budget ε (example-level, add/remove)", "privacy")
    target_delta: float = _f(1e-5, "privacy budget δ (keep it well below 1/N)", "privacy")
    clip_norm: float = _f(1.0, "per-example clipping bound C (in the norm of --clip-norm-type)", "privacy")
    noise_multiplier: float | None = _f(
        None,
        "σ. Default: calibrated to (ε, δ) on the driver. If given, training stops when the budget is spent",
        "privacy",
    )
    max_noise_multiplier: float = _f(
        100.0, "refuse a plan whose calibrated σ exceeds this (the target ε is out of reach)", "privacy"
    )
    accountant: str = _f(
        "pld",
        "accountant: pld (tight; the default), rdp (Rényi DP, 8-20 percent looser), moments (Abadi et al.'s original moments accountant)",
        "privacy",
    )
    noise: str = _f(
        "gaussian",
        "noise: gaussian (DP-SGD), or laplace (the DP-Adam paper's form, made honest: needs --clip-norm-type l1, pld accountant)",
        "privacy",
    )
    clip_norm_type: str = _f("l2", "per-example clipping norm: l2, or l1 (for laplace noise)", "privacy")
    seed: int | None = _f(
        None,
        "seed for noise and sampling: tests and research only. Default: secure mode (OS entropy, no seed)",
        "privacy",
    )
    # method (Knolle et al. 2023 BAM; Park et al. 2023 DP-SAT; De et al. 2022 practice; Abadi et al. 2016 DP-PCA)
    method: str = _f(
        "dpsgd",
        "dpsgd; bam (per-example ascent before clipping); dpsat (ascent along the previous private gradient)",
        "method",
    )
    ascent: float | None = _f(
        None, "ascent radius: λ for bam (default 0.02), ρ for dpsat (default 0.086); 0 is DP-SGD", "method"
    )
    ascent_schedule: str = _f(
        "constant", "λ/ρ over the run: constant, warmup (linear from 0), cosine (down to 0)", "method"
    )
    ascent_warmup_fraction: float = _f(0.1, "fraction of the steps the warmup schedule takes", "method")
    bam_variant: str = _f(
        "sam", "bam: sam (gradient at θ+λg_i/‖g_i‖) or exact (∇L_i + λH_i g_i/‖g_i‖, forward-over-reverse)", "method"
    )
    augmentation_multiplicity: int = _f(
        1,
        "K augmented copies per example (random crop with padding, flip), gradients averaged before clipping",
        "method",
    )
    augment_padding: int = _f(4, "random-crop padding in pixels (augmentation multiplicity)", "method")
    augment_flip: bool = _f(True, "random horizontal flips (augmentation multiplicity)", "method")
    ema_decay: float | None = _f(
        None, "parameter EMA decay (De et al.: 0.999); evaluation and the logged model use the average", "method"
    )
    pca_components: int = _f(
        0, "DP-PCA: project the inputs on k private principal directions (0: off; mlp only)", "method"
    )
    pca_noise_multiplier: float = _f(8.0, "DP-PCA: σ of the symmetric noise on AᵀA (sensitivity 1)", "method")
    pca_sample_rate: float = _f(1.0, "DP-PCA: Poisson rate of the rows used (1: all)", "method")
    # audit (Steinke, Nasr and Jagielski 2023: one training run)
    audit_canaries: int = _f(0, "one-run privacy audit: m canaries (0: off)", "audit")
    audit_kind: str = _f(
        "gradient",
        "gradient: white-box, each canary's gradient is C·e_j on a coordinate of its own (m ≤ parameters), scored by "
        "the released gradients; input: black-box, out-of-distribution images with random labels, scored by the "
        "final model's loss",
        "audit",
    )
    audit_canary_rate: float = _f(0.5, "probability that each canary is in the training data (the paper: 1/2)", "audit")
    audit_guesses: int | None = _f(
        None,
        "guesses r: 'in' for the r/2 highest scores, 'out' for the r/2 lowest, abstain on the rest (fixed before the "
        "run; default min(200, m))",
        "audit",
    )
    # cluster
    num_workers: int = _f(2, "Ray Train workers (each samples its own shard)", "cluster")
    use_gpu: bool = _f(False, "one GPU per worker, NCCL (default: CPU, gloo)", "cluster")
    in_process: bool = _f(
        False,
        "train in this process with Ray Train's local mode: no Ray cluster and no worker processes, so it starts in "
        "seconds; one worker (num_workers=1), no automatic restarts (--resume still works)",
        "cluster",
    )
    physical_batch_size: int = _f(256, "examples per per-example-gradient call (memory, not privacy)", "cluster")
    memory_budget_mb: float = _f(
        0.0,
        "per-worker memory budget (MiB) for the per-example gradients: the physical batch size becomes the largest "
        "power of two ≤ physical_batch_size that fits, measured at start (0: off)",
        "cluster",
    )
    clipping: str = _f(
        "auto",
        "per-example clipping: auto (bookkeeping where the model and method allow it, else vmap), vmap (any model), or "
        "bookkeeping (Linear/Conv2d/WSConv2d/GroupNorm models; faster; verified against vmap on the first batch, "
        "else vmap)",
        "cluster",
    )
    checkpoint_every: int = _f(0, "steps between checkpoints and evaluations (0: about 10 per run)", "cluster")
    max_failures: int = _f(2, "worker-group restarts from the last checkpoint before the run fails", "cluster")
    ray_address: str | None = _f(
        None,
        "Ray cluster to join ('auto', ray://...). Default: RAY_ADDRESS, else a local cluster started and stopped here",
        "cluster",
    )
    storage_path: str = _f(
        "dp_runs",
        "where checkpoints, the ledger journal and ingested data go (shared storage on a cluster; default: "
        "$DP_STORAGE_PATH, else ./dp_runs)",
        "cluster",
    )
    # tracking
    tracking_uri: str = _f(
        "sqlite:///mlflow.db",
        "MLflow tracking URI (default: $MLFLOW_TRACKING_URI, which mlflow.set_tracking_uri also sets, else ./mlflow.db)",
        "tracking",
    )
    experiment: str = _f("dp-training", "MLflow experiment", "tracking")
    run_name: str | None = _f(None, "MLflow run name (default: dataset-model-time)", "tracking")
    registered_model: str | None = _f(
        None, "name in the MLflow model registry (default: dp-<dataset>-<model>; 'none' to skip)", "tracking"
    )
    diagnostics: bool = _f(
        False,
        "NON-PRIVATE: also log training loss/accuracy and clip fractions; tags the run dp.diagnostics=non-private",
        "tracking",
    )
    test_every_report: bool = _f(
        True,
        "evaluate the test split at every report; --no-test-every-report: only at the end, so that nothing chosen "
        "during the run (pruning, early looks) can depend on it",
        "tracking",
    )
    log_model: bool = _f(True, "log (and register) the final model; sweeps log only the best trial's", "tracking")
    quiet: bool = _f(False, "no progress output", "tracking")

    # ------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Check every field that needs no data. Raises DPConfigError naming the value and the fix."""
        err = dpcore.DPConfigError
        check_dataset_and_model(self)
        if self.clipping not in dpcore.optimizer.CLIPPING_MODES:
            raise err(
                f"clipping={self.clipping!r} is unknown; available: {', '.join(dpcore.optimizer.CLIPPING_MODES)}."
            )
        if self.ascent is not None and (isinstance(self.ascent, bool) or not isinstance(self.ascent, (int, float))):
            raise err(f"ascent={self.ascent!r} has the wrong type: expected a number.")
        dpcore.check_method_options(
            method=self.method,
            ascent=self.resolved_ascent(),
            bam_variant=self.bam_variant,
            noise=self.noise,
            clip_norm_type=self.clip_norm_type,
            augmentation_multiplicity=self.augmentation_multiplicity,
            clipping=self.clipping,
            accountant=self.accountant,
        )
        if self.ascent is not None and self.method == "dpsgd" and self.ascent != 0:
            raise err(
                f"ascent={self.ascent} has no effect with method='dpsgd'; set --method bam or dpsat, or drop --ascent."
            )
        if self.method != "bam" and self.bam_variant != "sam":
            raise err(f"bam_variant={self.bam_variant!r} has no effect with method={self.method!r}; set --method bam.")
        if self.method == "dpsgd" and self.ascent_schedule != "constant":
            raise err(
                f"ascent_schedule={self.ascent_schedule!r} has no effect with method='dpsgd'; set --method bam or dpsat."
            )
        if self.ascent_schedule not in dpcore.methods.ASCENT_SCHEDULES:
            raise err(
                f"ascent_schedule={self.ascent_schedule!r} is unknown; available: {', '.join(dpcore.methods.ASCENT_SCHEDULES)}."
            )
        if not (0 < self.ascent_warmup_fraction <= 1):
            raise err(f"ascent_warmup_fraction={self.ascent_warmup_fraction} must lie in (0, 1].")
        if (
            isinstance(self.augment_padding, bool)
            or not isinstance(self.augment_padding, int)
            or self.augment_padding < 0
        ):
            raise err(f"augment_padding={self.augment_padding!r} is invalid: it must be an integer ≥ 0.")
        if self.ema_decay is not None and not (0 <= self.ema_decay < 1):
            raise err(f"ema_decay={self.ema_decay} must lie in [0, 1) (De et al. use 0.999).")
        if isinstance(self.pca_components, bool) or not isinstance(self.pca_components, int) or self.pca_components < 0:
            raise err(
                f"pca_components={self.pca_components!r} is invalid: it is the number k ≥ 1 of principal directions "
                "kept by DP-PCA, or 0 for no projection."
            )
        if self.pca_components:
            dpcore.validation.check_noise_multiplier(self.pca_noise_multiplier, "pca_noise_multiplier")
            dpcore.validation.check_sample_rate(self.pca_sample_rate, "pca_sample_rate")
            if self.model != "mlp":
                raise err(
                    f"pca_components={self.pca_components} projects the inputs to vectors, which only model='mlp' "
                    f"takes (not {self.model!r})."
                )
        if self.optimizer not in OPTIMIZERS:
            raise err(f"optimizer={self.optimizer!r} is unknown; available: {', '.join(OPTIMIZERS)}.")
        for name in ("lr", "epochs", "max_noise_multiplier"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise err(f"{name}={v!r} is invalid: it must be a finite number > 0.")
        if not (0 <= self.momentum < 1):
            raise err(f"momentum={self.momentum!r} is invalid: it must lie in [0, 1).")
        dpcore.validation.check_epsilon(self.target_epsilon)
        dpcore.validation.check_delta(self.target_delta)
        dpcore.validation.check_clip_norm(self.clip_norm)
        if self.noise_multiplier is not None:
            dpcore.validation.check_noise_multiplier(self.noise_multiplier)
        dpcore.accountants.check_accountant(self.accountant)
        for name in ("lot_size", "physical_batch_size", "num_workers", "generated_size"):
            dpcore.validation.check_positive_int(getattr(self, name), name)
        if (
            isinstance(self.memory_budget_mb, bool)
            or not isinstance(self.memory_budget_mb, (int, float))
            or not (self.memory_budget_mb == 0 or 1 <= self.memory_budget_mb < float("inf"))
        ):
            raise err(
                f"memory_budget_mb={self.memory_budget_mb!r} is invalid: it must be 0 (off) or a number of MiB ≥ 1."
            )
        for name in ("checkpoint_every", "max_failures", "split_seed", "init_seed", "train_subset"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise err(f"{name}={v!r} is invalid: it must be an integer ≥ 0.")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise err(f"seed={self.seed!r} is invalid: a seed must be a non-negative integer.")
        if "://" in self.storage_path:
            raise err(
                f"storage_path={self.storage_path!r}: only filesystem paths are supported (local, or a shared mount "
                "such as NFS on a cluster): the ledger journal needs POSIX append, fsync and locks."
            )
        check_audit_options(self)
        if self.audit_canaries and self.audit_kind not in ("gradient", "input"):
            raise err(f"audit_kind={self.audit_kind!r} is unknown; use gradient (white-box) or input (black-box).")
        if self.in_process and self.num_workers != 1:
            raise err(
                f"in_process trains one worker in this process; num_workers={self.num_workers} needs Ray workers (drop --in-process)."
            )

    def resolved_ascent(self) -> float:
        """λ or ρ: the given value, or the method's default from the papers (CIFAR-10 settings)."""
        if self.ascent is not None:
            return float(self.ascent)
        return {"bam": 0.02, "dpsat": 0.086}.get(self.method, 0.0)

    def resolved_audit_guesses(self) -> int:
        return min(200, self.audit_canaries) if self.audit_guesses is None else self.audit_guesses

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def check_dataset_and_model(cfg) -> None:
    """``cfg.dataset`` (with its data_dir) and ``cfg.model`` name things that exist."""
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
            import json

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
    if not (cfg.model in MODELS[:-1] or (cfg.model.startswith("tv:") and len(cfg.model) > 3)):
        raise err(f"model={cfg.model!r} is unknown; available: {', '.join(MODELS)}.")
    if getattr(cfg, "activation", None) is not None:
        check_activation(cfg.activation)


def check_audit_options(cfg) -> None:
    """The one-run audit's options, shared by the training and the federated configs."""
    err = dpcore.DPConfigError
    m = cfg.audit_canaries
    if isinstance(m, bool) or not isinstance(m, int) or m < 0:
        raise err(f"audit_canaries={m!r} is invalid: it is the number of canaries m ≥ 1, or 0 for no audit.")
    if not m:
        return
    if not (0.0 < cfg.audit_canary_rate < 1.0):
        raise err(
            f"audit_canary_rate={cfg.audit_canary_rate!r} must lie strictly between 0 and 1 (the paper uses 0.5)."
        )
    r = cfg.resolved_audit_guesses()
    if isinstance(r, bool) or not isinstance(r, int) or not (2 <= r <= m):
        raise err(f"audit_guesses={cfg.audit_guesses!r} must be an integer in [2, audit_canaries={m}].")


def _coerce(name: str, value: Any, fields: dict | None = None) -> Any:
    """YAML/JSON values → the field's type (ints for int fields, floats for float fields)."""
    t = str((fields or FIELDS)[name].type)
    if value is None:
        if "None" in t:
            return None
        raise dpcore.DPConfigError(f"{name}: null is not allowed.")
    try:
        if t.startswith("bool"):
            if not isinstance(value, bool):
                raise TypeError
            return value
        if t.startswith("int"):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError
            return int(value)
        if t.startswith("float"):
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise dpcore.DPConfigError(f"{name}={value!r} has the wrong type: expected {t}.") from None


# Options whose default comes from the environment when it is set (a cluster's nodes carry them,
# e.g. from `dp-platform stack` or a Kubernetes Secret); a YAML file or a flag still wins.
ENV_DEFAULTS = {"tracking_uri": "MLFLOW_TRACKING_URI", "storage_path": "DP_STORAGE_PATH"}


def config_from_dict(values: dict[str, Any], cls=TrainConfig):
    """A ``cls`` (TrainConfig by default; any frozen config dataclass built with ``_f``) from
    plain values, with types checked and unknown keys refused. Options in :data:`ENV_DEFAULTS`
    that are not given default to their environment variable when it is set."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    given = {str(k).replace("-", "_") for k in values}
    values = {
        **{n: os.environ[v] for n, v in ENV_DEFAULTS.items() if n in fields and n not in given and os.environ.get(v)},
        **values,
    }
    clean = {}
    for key, value in values.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            close = [n for n in fields if n.split("_")[0] == name.split("_")[0]][:3]
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise dpcore.DPConfigError(f"unknown config key {key!r}.{hint} See --help for the list.")
        clean[name] = _coerce(name, value, fields)
    return cls(**clean)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None, cls=TrainConfig):
    """Defaults ← YAML file (if any) ← overrides (CLI flags)."""
    values: dict[str, Any] = {}
    if path is not None:
        import yaml

        p = Path(path)
        if not p.is_file():
            raise dpcore.DPConfigError(f"config file {str(p)!r} does not exist.")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise dpcore.DPConfigError(f"config file {p} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise dpcore.DPConfigError(f"config file {p} must hold a mapping of option: value.")
        values.update(loaded)
    values.update(overrides or {})
    return config_from_dict(values, cls)


def add_config_arguments(parser: argparse.ArgumentParser, cls=TrainConfig) -> None:
    """One flag per field, grouped, with the field's help. Defaults are SUPPRESSed so that only
    the flags a user gives override the YAML file."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(cls):
        g = f.metadata["group"]
        if g not in groups:
            groups[g] = parser.add_argument_group(g)
        flag = "--" + f.name.replace("_", "-")
        t = str(f.type)
        helptext = f.metadata["help"]
        if "default" not in helptext.lower() and f.default is not None:  # never "(default 8) (default: None)"
            helptext += f" (default: {f.default})"
        if t.startswith("bool"):
            groups[g].add_argument(
                flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=helptext
            )
        else:
            kind = int if t.startswith("int") else float if t.startswith("float") else str
            groups[g].add_argument(flag, type=kind, default=argparse.SUPPRESS, metavar=f.name.upper(), help=helptext)
