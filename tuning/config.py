"""A sweep's own options (beside the training config every trial shares), its Optuna storage,
and the check that every lot size of the space can meet the target (ε, δ)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import dpcore
from pipelines.config.options import Section, option
from pipelines.tracking import redact

from .space import SearchSpace

SAMPLERS = ("tpe", "random")
PRUNERS = ("none", "median")
PRESETS = ("bam-appendix",)
DISTRIBUTIONS = ("poisson", "negative-binomial")  # of the number of trials, for private selection
MEDIAN_PRUNER = {"n_startup_trials": 2, "n_warmup_steps": 0}


@dataclass(frozen=True)
class SweepConfig(Section):
    """A sweep's own options. The training options every trial shares are a TrainConfig beside it."""

    SECTION = "sweep"

    study: str = option("dp-sweep", "study name; the same name continues it")
    storage: str = option(
        "sqlite:///optuna.db",
        "Optuna RDB storage URL (default: $DP_OPTUNA_STORAGE, else sqlite:///optuna.db; postgresql://... on a cluster)",
    )
    n_trials: int = option(20, "finished trials to reach")
    max_concurrent: int = option(2, "trials running at once")
    sampler: str = option("tpe", "tpe (default) or random", choices=SAMPLERS)
    pruner: str = option("none", "none (default) or median (on intermediate validation accuracy)", choices=PRUNERS)
    sampler_seed: int | None = option(None, "seed of the sampler (public)")
    heartbeat_interval: int = option(10, "seconds between trial heartbeats")
    grace_period: int = option(30, "seconds without heartbeat before a trial is stale and retried")
    max_retry: int = option(2, "retries of a trial whose process died")
    max_failed_trials: int = option(
        3,
        "failed trials (an error, or a process that died) after which the sweep launches no more; it starts at most "
        "n_trials + this many trials, the K of its privacy bound",
    )
    private_selection: str | None = option(
        None,
        "account the choice of the best trial (Papernot & Steinke): a random number of trials from this distribution",
        choices=DISTRIBUTIONS,
    )
    selection_mean: float = option(8.0, "mean number of trials")
    selection_shape: float = option(1.0, "negative-binomial shape η (1 = geometric)")
    selection_noise_multiplier: float = option(2.0, "σ of the noise on the validation count")
    preset: str | None = option(
        None, "bam-appendix: stage 1 DP-SGD (lr, lot), stage 2 λ for BAM and ρ for DP-SAT", choices=PRESETS
    )
    space: dict | None = option(None, "the search space (a 'space:' mapping in the YAML file)", flag=False)
    quiet: bool = option(False, "no progress output", flag=False)  # the training flag --quiet sets it

    def validate(self) -> None:
        err = dpcore.DPConfigError
        if not self.study or any(c in self.study for c in "/\\ "):
            raise err(f"study={self.study!r}: give a name without spaces or slashes.")
        for name in ("n_trials", "max_concurrent", "heartbeat_interval", "grace_period", "max_failed_trials"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise err(f"{name}={v!r} is invalid: it must be an integer ≥ 1.")
        if self.grace_period <= self.heartbeat_interval:
            raise err(f"grace_period={self.grace_period} must exceed heartbeat_interval={self.heartbeat_interval}.")
        if self.sampler not in SAMPLERS:
            raise err(f"sampler={self.sampler!r} is unknown; choose one of {', '.join(SAMPLERS)}.")
        if self.pruner not in PRUNERS:
            raise err(f"pruner={self.pruner!r} is unknown; choose one of {', '.join(PRUNERS)}.")
        if self.preset is not None and self.preset not in PRESETS:
            raise err(f"preset={self.preset!r} is unknown; available: {', '.join(PRESETS)}.")
        if self.private_selection is not None:
            if self.private_selection not in DISTRIBUTIONS:
                raise err(
                    f"private_selection={self.private_selection!r} is unknown; choose one of {', '.join(DISTRIBUTIONS)}."
                )
            if self.sampler != "random" or self.pruner != "none":
                raise err(
                    "--private-selection needs --sampler random and --pruner none: Papernot & Steinke's bound holds for "
                    "independent repetitions of one randomised algorithm; TPE and pruning adapt to earlier trials' private results."
                )
            if not (self.selection_mean >= 1 and math.isfinite(self.selection_mean)):
                raise err(f"selection_mean={self.selection_mean} must be a finite number ≥ 1.")
            dpcore.validation.check_noise_multiplier(self.selection_noise_multiplier, "selection_noise_multiplier")
            if self.sampler_seed is not None:
                raise err(
                    "--private-selection and --sampler-seed cannot be combined: Papernot & Steinke's bound holds for K "
                    "independent runs of one randomised algorithm, and a public seed makes each trial's hyperparameters a "
                    "known function of its number (the released best would say which trial won). The sampler draws from "
                    "OS entropy (or from --seed, for tests)."
                )
            if self.preset is not None:
                raise err(
                    "--private-selection and --preset cannot be combined (the preset's stage 2 depends on stage 1's choice)."
                )


SWEEP_FIELDS = {f.name for f in dataclasses.fields(SweepConfig)}


# ------------------------------------------------------------------------------------------
def make_storage(url: str, sweep: SweepConfig):
    """The Optuna RDB storage, with heartbeats and the stale-trial retry. Raises a clear error
    if the database cannot be reached (nothing is written then)."""
    import optuna

    if "://" not in url:
        raise dpcore.DPConfigError(
            f"storage={redact(url)!r} is not a database URL; use sqlite:///path.db or postgresql://user@host/db."
        )
    if url.startswith("sqlite:///"):
        parent = Path(url[len("sqlite:///") :]).expanduser().resolve().parent
        if not parent.is_dir():
            raise dpcore.DPConfigError(f"storage={redact(url)!r}: the folder {parent} does not exist.")
    try:
        import sqlalchemy

        engine = sqlalchemy.create_engine(
            url, connect_args={"connect_timeout": 5} if url.startswith("postgresql") else {}
        )
        with engine.connect():
            pass
        engine.dispose()
    except Exception as e:  # noqa: BLE001 - any driver error means: unreachable
        raise dpcore.DPConfigError(
            f"the Optuna storage {redact(url)} is unreachable ({type(e).__name__}: {str(e).splitlines()[0]}); fix --storage."
        ) from None
    return optuna.storages.RDBStorage(
        url,
        heartbeat_interval=sweep.heartbeat_interval,
        grace_period=sweep.grace_period,
        heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=sweep.max_retry),
    )


def check_feasible(base, space: SearchSpace, dataset_size: int) -> list[int] | None:
    """Every lot size the space can pick must allow σ ≤ max_noise_multiplier at (ε, δ) for the
    longest epochs it can pick. Returns the feasible lot choices (categorical spaces), or raises."""
    lot = space.get("lot_size")
    lots = lot.values_at_extremes() if lot is not None else [base.lot_size]
    ep = space.get("epochs")
    epochs = max(ep.values_at_extremes()) if ep is not None else base.epochs
    ok, bad = [], {}
    for L in lots:
        try:
            options = {**base.plan_options(), "lot_size": int(L), "epochs": epochs}
            dpcore.plan(dataset_size=dataset_size, prior_groups=base.prior_groups(), **options)
            ok.append(L)
        except dpcore.DPConfigError as e:
            bad[L] = str(e)
    if not ok:
        first = next(iter(bad.values()))
        raise dpcore.DPConfigError(
            f"no trial can meet ε={base.target_epsilon:g} at δ={base.target_delta:g}: calibration fails for every lot size "
            f"({', '.join(map(str, lots))}) at {epochs:g} epochs. For example: {first}"
        )
    if bad and (lot is None or lot.choices is None):
        raise dpcore.DPConfigError(
            f"lot sizes {sorted(bad)} cannot meet ε={base.target_epsilon:g} at {epochs:g} epochs; narrow the lot_size range."
        )
    return ok if (lot is not None and lot.choices is not None) else None


# ------------------------------------------------------------------------------------------
