"""The federated run's config (one frozen dataclass; YAML and flags fill it)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import dpcore
from dpcore.federated import CLIP_POLICIES, AdaptiveClipping

from ..config import _f, check_audit_options, check_dataset_and_model
from ..data import DATASETS
from ..models import MODELS
from .clients import SPLITS

STOPPING = ("epsilon", "delta")
EXECUTORS = ("ray", "local")
BYTES_PER_FLOAT = 4


@dataclass(frozen=True)
class FederatedConfig:
    # data and clients
    dataset: str = _f(
        "digits", f"dataset: {', '.join(DATASETS)} (its training split is divided among the clients)", "data"
    )
    data_dir: str | None = _f(None, "folder holding the dataset (torchvision layout or an ImageFolder tree)", "data")
    download: bool = _f(False, "download the torchvision dataset into data_dir (needs a network)", "data")
    image_size: int | None = _f(None, "size of 'generated' images / resize of ImageFolder images", "data")
    generated_size: int = _f(
        10_000, "examples of the 'generated' dataset (a generated client population for scale tests)", "data"
    )
    val_fraction: float = _f(
        0.1, "fraction of the data held out for validation (on the server, not on clients)", "data"
    )
    test_fraction: float = _f(0.2, "fraction held out for testing, for datasets without their own test set", "data")
    split_seed: int = _f(0, "seed of the public train/val/test split and of the client split", "data")
    num_clients: int = _f(100, "K: clients; the guarantee protects any one client's whole dataset", "data")
    split: str = _f(
        "noniid", f"how the training data is divided: {', '.join(SPLITS)} (noniid: sorted by label, shards)", "data"
    )
    shards_per_client: int = _f(2, "noniid: label-sorted shards per client (Geyer et al.: 2)", "data")
    # model and training
    model: str = _f("mlp", f"model: {', '.join(MODELS)}", "model")
    init_seed: int = _f(0, "seed of the initial weights (public)", "model")
    local_epochs: int = _f(1, "E: local epochs per round on each sampled client", "model")
    local_batch_size: int = _f(10, "B: local minibatch size", "model")
    local_lr: float = _f(0.1, "client SGD learning rate", "model")
    server_lr: float = _f(1.0, "server learning rate applied to the noised average update", "model")
    server_momentum: float = _f(0.0, "server momentum (FedAvgM; 0: plain DP-FedAvg)", "model")
    # privacy
    clients_per_round: float = _f(
        30.0, "m: expected clients per round; each client joins with probability m/K (Poisson)", "privacy"
    )
    clip_norm: float = _f(
        1.0, "S: every client's update is clipped to L2 norm ≤ S (the initial S with adaptive clipping)", "privacy"
    )
    clip_policy: str = _f(
        "fixed",
        "fixed S; adaptive (DP quantile estimate of Andrew et al. 2021, ledgered); median_nonprivate (Geyer et al.'s "
        "S: NOT PRIVATE, diagnostics only)",
        "privacy",
    )
    target_quantile: float = _f(0.5, "adaptive: the quantile γ of update norms that S tracks", "privacy")
    quantile_lr: float = _f(0.2, "adaptive: η of the geometric update S ← S·exp(−η(b̄ − γ))", "privacy")
    quantile_noise: float | None = _f(
        None, "adaptive: σ_b, the noise on the count of updates under S (default m/20)", "privacy"
    )
    noise_multiplier: float | None = _f(
        None, "z: noise multiplier of a round. Default: calibrated to (ε, δ) for --rounds", "privacy"
    )
    rounds: int = _f(
        50,
        "rounds to run (σ is calibrated for them); 0: until the budget is spent (needs --noise-multiplier)",
        "privacy",
    )
    target_epsilon: float = _f(8.0, "ε of the budget (client-level, add/remove one client)", "privacy")
    target_delta: float = _f(1e-3, "δ of the budget; with --stopping delta it is Geyer et al.'s bound Q", "privacy")
    stopping: str = _f(
        "epsilon",
        "epsilon: stop before ε at δ passes the target; delta: Geyer et al.'s rule, stop before δ at the fixed ε passes Q",
        "privacy",
    )
    accountant: str = _f("pld", f"accountant: {', '.join(dpcore.ACCOUNTANTS)}", "privacy")
    seed: int | None = _f(
        None, "seed for client sampling and noise: tests and research only (default: secure, OS entropy)", "privacy"
    )
    # audit (Steinke et al. 2023, one run): canary clients whose update is a fixed direction
    audit_canaries: int = _f(
        0, "one-run audit: m canary clients, each owning one parameter coordinate (0: off)", "audit"
    )
    audit_canary_rate: float = _f(0.5, "probability that each canary client is in the population", "audit")
    audit_guesses: int | None = _f(
        None, "guesses r: 'in' for the r/2 highest scores, 'out' for the r/2 lowest (default min(200, m))", "audit"
    )
    # cluster
    num_actors: int = _f(2, "Ray actors that simulate the clients (each serves many clients)", "cluster")
    cpus_per_actor: float = _f(1.0, "CPUs reserved per actor", "cluster")
    executor: str = _f("ray", "ray (client actors), or local (one in-process loop, for comparison)", "cluster")
    max_actor_restarts: int = _f(3, "actors replaced after dying before the run fails", "cluster")
    ray_address: str | None = _f(None, "Ray cluster to join; default RAY_ADDRESS, else a local cluster", "cluster")
    storage_path: str = _f("dp_runs", "where the ledger journal goes", "cluster")
    # tracking
    tracking_uri: str = _f("sqlite:///mlflow.db", "MLflow tracking URI", "tracking")
    experiment: str = _f("dp-federated", "MLflow experiment", "tracking")
    run_name: str | None = _f(None, "MLflow run name (default: fedavg-dataset-K-time)", "tracking")
    registered_model: str | None = _f(
        None, "name in the model registry (default: dp-fedavg-<dataset>-<model>; 'none' to skip)", "tracking"
    )
    log_model: bool = _f(True, "log and register the final model", "tracking")
    eval_every: int = _f(0, "rounds between evaluations and ε reports (0: about 20 per run)", "tracking")
    diagnostics: bool = _f(
        False,
        "NON-PRIVATE: also log realised clients and bytes per round and update norms; tags dp.diagnostics=non-private",
        "tracking",
    )
    quiet: bool = _f(False, "no progress output", "tracking")
    # testing only
    fault_at_round: int | None = _f(None, "fault injection for tests: one actor dies once, in this round", "testing")
    fault_actor: int = _f(0, "the actor that fault_at_round kills", "testing")

    def validate(self) -> None:
        err = dpcore.DPConfigError
        check_dataset_and_model(self)
        for name, choices in (
            ("split", SPLITS),
            ("clip_policy", CLIP_POLICIES),
            ("stopping", STOPPING),
            ("executor", EXECUTORS),
        ):
            if getattr(self, name) not in choices:
                raise err(f"{name}={getattr(self, name)!r} is unknown; use one of {', '.join(choices)}.")
        for name in (
            "num_clients",
            "shards_per_client",
            "local_epochs",
            "local_batch_size",
            "num_actors",
            "generated_size",
        ):
            dpcore.validation.check_positive_int(getattr(self, name), name)
        m = self.clients_per_round
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or m <= 0:
            raise err(f"clients_per_round={m!r} is invalid: it must be a number > 0 (the expected clients per round).")
        if m > self.num_clients:
            raise err(
                f"clients_per_round m={m:g} exceeds num_clients K={self.num_clients}: m/K is the probability that a client "
                f"joins a round, so m ≤ K. Lower clients_per_round or raise num_clients."
            )
        dpcore.validation.check_clip_norm(self.clip_norm, "clip_norm")
        for name in ("local_lr", "server_lr", "cpus_per_actor"):
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not math.isfinite(v)
                or v < 0
                or (v == 0 and name != "local_lr")
            ):
                raise err(
                    f"{name}={v!r} is invalid: it must be a finite number > 0{' (or 0)' if name == 'local_lr' else ''}."
                )
        if not (0 <= self.server_momentum < 1):
            raise err(f"server_momentum={self.server_momentum!r} must lie in [0, 1).")
        dpcore.validation.check_epsilon(self.target_epsilon)
        dpcore.validation.check_delta(self.target_delta)
        dpcore.accountants.check_accountant(self.accountant)
        if self.noise_multiplier is not None:
            dpcore.validation.check_noise_multiplier(self.noise_multiplier)
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 0:
            raise err(
                f"rounds={self.rounds!r} is invalid: it must be an integer ≥ 1, or 0 to run until the budget is spent."
            )
        if self.noise_multiplier is None and self.rounds == 0:
            raise err(
                "rounds=0 runs until the budget is spent, which needs a given --noise-multiplier; or give --rounds and "
                "σ is calibrated to (ε, δ)."
            )
        if self.clip_policy == "adaptive":
            AdaptiveClipping(self.clip_norm, self.target_quantile, self.quantile_lr, self.resolved_quantile_noise())
        elif self.quantile_noise is not None:
            raise err(
                f"quantile_noise={self.quantile_noise} has no effect with clip_policy={self.clip_policy!r}; set --clip-policy adaptive."
            )
        if self.clip_policy == "median_nonprivate" and not self.diagnostics:
            raise err(
                "clip_policy='median_nonprivate' sets S to the median of the sampled clients' update norms without noise "
                "(Geyer et al.): that releases private data and voids the guarantee. It is a diagnostics option only; add "
                "--diagnostics to run it (the run is tagged non-private), or use --clip-policy adaptive (private)."
            )
        check_audit_options(self)
        if self.eval_every < 0 or self.max_actor_restarts < 0:
            raise err("eval_every and max_actor_restarts must be integers ≥ 0.")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise err(f"seed={self.seed!r} is invalid: a seed must be a non-negative integer.")
        if self.fault_at_round is not None and not (0 <= self.fault_actor < self.num_actors):
            raise err(f"fault_actor={self.fault_actor} must be an actor index in [0, {self.num_actors}).")

    def resolved_quantile_noise(self) -> float:
        return float(self.quantile_noise) if self.quantile_noise is not None else self.clients_per_round / 20.0

    def resolved_audit_guesses(self) -> int:
        return min(200, self.audit_canaries) if self.audit_guesses is None else self.audit_guesses

    def to_dict(self) -> dict[str, Any]:
        import dataclasses

        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------
# Executors: the same ClientRunner in this process, or on a pool of Ray actors.
