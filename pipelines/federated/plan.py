"""The federated run's plan, computed on the driver before any round: the data and its split
among the clients, σ calibrated to (ε, δ) for the rounds, the run's folder; and its tags."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import torch

import dpcore

from .. import tracking
from ..data import load_configured
from ..models import build_model
from .clients import split_clients
from .config import FederatedConfig


def load_data(cfg: FederatedConfig):
    """Train/val/test splits as model inputs (float32, normalised; clients' data is small and
    simulated in memory): an ingested dataset (data_dir with manifest.json) or a dataset loaded
    through its source (IDX files, torchvision, scikit-learn, the generator)."""
    from ..data import Split

    if cfg.data_dir and (Path(cfg.data_dir).expanduser() / "manifest.json").is_file():
        from ..data import open_split, read_manifest, verify

        path = Path(cfg.data_dir).expanduser()
        verify(path)
        manifest = read_manifest(path)
        splits = {}
        for s in ("train", "val", "test"):
            m = open_split(path, s)
            splits[s] = Split(m.batch(torch.arange(len(m))), m.y.clone())
        return SimpleNamespace(
            name=manifest.get("name", cfg.dataset),
            num_classes=manifest["num_classes"],
            input_shape=tuple(manifest["input_shape"]),
            **splits,
        )
    ds = load_configured(cfg)
    splits = {s: Split(ds.inputs(s), getattr(ds, s).y) for s in ("train", "val", "test")}
    return SimpleNamespace(name=ds.name, num_classes=ds.num_classes, input_shape=ds.input_shape, **splits)


def plan_federated(cfg: FederatedConfig) -> dict:
    """Everything that can fail, checked before any round: config, data, split, model and the
    privacy plan. Returns the plan (data, split, z, rounds)."""
    cfg.validate()
    tracking_uri = tracking.resolve_tracking_uri(cfg.tracking_uri)
    tracking.check_tracking_uri(tracking_uri)
    data = load_data(cfg)
    order, offsets = split_clients(data.train.y, cfg.num_clients, cfg.split, cfg.shards_per_client, cfg.split_seed)
    model = build_model(cfg.model, tuple(data.input_shape), data.num_classes)
    dpcore.validate_model(model)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if cfg.audit_canaries > n_params:
        raise dpcore.DPConfigError(
            f"audit_canaries={cfg.audit_canaries} canary clients do not fit: each needs a parameter coordinate of its own and "
            f"model={cfg.model!r} has {n_params} trainable parameters. Use at most {n_params} canaries."
        )
    q = cfg.clients_per_round / cfg.num_clients
    dpcore.validation.check_delta(cfg.target_delta, dataset_size=cfg.num_clients)
    if cfg.noise_multiplier is None:
        z = dpcore.calibrate_noise_multiplier(
            cfg.target_epsilon, cfg.target_delta, q, cfg.rounds, accountant=cfg.accountant
        )
    else:
        z = float(cfg.noise_multiplier)
    event = dpcore.PrivacyEvent.dpsgd_step(z, q)
    if cfg.stopping == "delta":
        fit = dpcore.accountants.calibration.max_steps_by_delta(
            event, cfg.target_epsilon, cfg.target_delta, cfg.accountant, limit=cfg.rounds or 10**6
        )
    else:
        fit = dpcore.max_steps(z, q, cfg.target_epsilon, cfg.target_delta, cfg.accountant, limit=cfg.rounds or 10**6)
    if fit == 0:
        raise dpcore.DPConfigError(
            f"not one round fits the budget: one round at z={z:.4g}, q=m/K={q:.4g} already exceeds "
            f"ε={cfg.target_epsilon:g} at δ={cfg.target_delta:g}. Raise --noise-multiplier or the budget, or lower clients_per_round."
        )
    rounds = min(cfg.rounds, fit) if cfg.rounds else fit
    if cfg.clip_policy == "adaptive":
        dpcore.federated.split_noise_multiplier(z, cfg.resolved_quantile_noise())
    name = cfg.run_name or f"fedavg-{cfg.dataset}-K{cfg.num_clients}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(cfg.storage_path).resolve() / f"{name}-{uuid.uuid4().hex[:6]}"
    sizes = offsets[1:] - offsets[:-1]
    return {
        "data": data,
        "order": order,
        "offsets": offsets,
        "sample_rate": q,
        "noise_multiplier": z,
        "rounds": rounds,
        "rounds_that_fit": fit,
        "tracking_uri": tracking_uri,
        "run_name": name,
        "run_dir": run_dir,
        "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "client_sizes": (int(sizes.min()), float(sizes.float().mean()), int(sizes.max())),
    }


def run_tags(cfg: FederatedConfig, plan: dict, update_z: float) -> dict[str, str]:
    tags = {
        "dp.level": "client",
        "dp.neighbouring": "add/remove one client (all of its data)",
        "dp.sampling": "poisson (clients)",
        "dp.delta": f"{cfg.target_delta:g}",
        "dp.target_epsilon": f"{cfg.target_epsilon:g}",
        "dp.accountant": cfg.accountant,
        "dp.stopping": "ε at fixed δ" if cfg.stopping == "epsilon" else "δ at fixed ε (Geyer et al.)",
        "dp.noise_multiplier": f"{plan['noise_multiplier']:.6g}",
        "dp.update_noise_multiplier": f"{update_z:.6g}",
        "dp.sample_rate": f"{plan['sample_rate']:.6g}",
        "dp.clip_policy": cfg.clip_policy,
        "dp.randomness": "secure" if cfg.seed is None else f"seeded (seed={cfg.seed}; not for production)",
        "dp.method": "dp-fedavg" + ("m" if cfg.server_momentum else ""),
        "dp.run_dir": str(plan["run_dir"]),
        "dp.guarantee": "covers the clients' training data only; the server's validation/test splits and the initial "
        "weights are not covered",
    }
    if cfg.diagnostics:
        tags["dp.diagnostics"] = "non-private"
    if no_guarantee(cfg):
        tags["dp.guarantee"] = f"NONE: {no_guarantee(cfg)}"
    return tags


def no_guarantee(cfg: FederatedConfig) -> str | None:
    """Why a run's model has no DP guarantee, or None where it has one."""
    if cfg.clip_policy == "median_nonprivate":
        return "S is the non-private median of update norms (Geyer et al.); the ledger's ε does not hold."
    return None
