"""The one-run audit's canaries (Steinke et al. 2023): drawn on the driver before any worker
starts, kept in the run directory for the workers, and scored when the run ends."""

from __future__ import annotations

import os
from pathlib import Path

import dpcore

from ..config import TrainConfig
from ..plan import RunPlan
from ..text.hf import is_hf, random_token_texts
from .checkpoint import load_final_model


def ensure_audit(plan: RunPlan, cfg: TrainConfig) -> None:
    """The one-run audit's canaries, drawn on the driver before any worker starts: m distinct
    parameter coordinates (public: a permutation seeded by init_seed) and which canaries are in
    the training data (each with probability audit_canary_rate, from the run's randomness:
    secure by default). Kept in the run directory for the workers and the final scoring; a
    resumed run re-uses them."""
    if not cfg.audit_canaries or Path(plan.audit_path).is_file():
        return
    import torch

    included = (
        dpcore.make_randomness(cfg.seed).spawn("audit-membership").uniform(cfg.audit_canaries) < cfg.audit_canary_rate
    )
    g = torch.Generator().manual_seed(
        cfg.init_seed + 7919
    )  # public: the canaries themselves are not secret, their membership is
    if cfg.audit_kind == "gradient":
        state = {
            "kind": "gradient",
            "coords": torch.randperm(plan.parameters, generator=g)[: cfg.audit_canaries],
            "included": included,
        }
    else:  # out-of-distribution inputs with random labels: Gaussian-noise images, or random token sequences
        shape = (cfg.audit_canaries, *plan.input_shape)
        x = random_token_texts(cfg.model, shape, g) if is_hf(cfg.model) else 3.0 * torch.randn(shape, generator=g)
        y = torch.randint(0, plan.num_classes, (cfg.audit_canaries,), generator=g)
        state = {"kind": "input", "x": x, "y": y, "included": included}
    tmp = Path(plan.audit_path + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, plan.audit_path)


def audit_result(plan: RunPlan, cfg: TrainConfig, checkpoint: str) -> dict:
    """Score the canaries, guess, and bound ε (Steinke et al.): the audit's summary. Gradient
    canaries: Σ_t ⟨released gradient_t, e_j⟩, accumulated by rank 0 and kept in the
    checkpoint. Input canaries: minus the final model's loss on each (a black-box score)."""
    import torch
    import torch.nn.functional as F

    canaries = torch.load(plan.audit_path)
    if canaries["kind"] == "gradient":
        scores = torch.load(Path(checkpoint) / "audit_scores.pt")
    else:
        model = load_final_model(plan, checkpoint)
        with torch.no_grad():  # in chunks: a text model's 1,000 canaries at once would hold GiBs of attention
            scores = torch.cat(
                [
                    -F.cross_entropy(model(x), y, reduction="none").double()
                    for x, y in zip(canaries["x"].split(256), canaries["y"].split(256))
                ]
            )
    r = cfg.resolved_audit_guesses()
    res = dpcore.audit.one_run_audit(
        scores.numpy(), canaries["included"].numpy(), r - r // 2, r // 2, delta=cfg.target_delta
    )
    return {
        "canaries": res.canaries,
        "guesses": res.guesses,
        "correct": res.correct,
        "epsilon_lower_bound": res.epsilon_lower_bound,
        "confidence": res.confidence,
        "included": int(canaries["included"].sum()),
        "scores": scores,
        "kind": canaries["kind"],
        "coords": canaries.get("coords", torch.arange(len(scores))),
        "membership": canaries["included"],
    }
