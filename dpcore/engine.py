"""One facade that wires the pieces together for a run: validate, calibrate, build.

    private = make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                           dataset_size=N, lot_size=256, epochs=10,
                           target_epsilon=2.0, target_delta=1e-5, clip_norm=1.0)
    for lot in private.sampler:
        private.optimizer.accumulate(X[lot], Y[lot])
        private.optimizer.step()
    print(private.ledger.epsilon())

Every input is checked here, before the sampler draws anything or any noise is added.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .accountants import analytic, calibration, epsilon
from .errors import DPConfigError
from .events import POISSON_GAUSSIAN, POISSON_LAPLACE, PrivacyEvent, positive_groups
from .grad_sample import LossFn
from .ledger import PrivacyLedger
from .methods import check_method_options
from .optimizer import DPOptimizer, ReduceFn
from .precision import check_autocast
from .randomness import Randomness, make_randomness
from .sampling import PoissonSampler, shard_indices
from .validation import (
    check_clip_norm,
    check_dataset_size,
    check_delta,
    check_epsilon,
    check_noise_multiplier,
    check_positive_int,
    sample_rate_from_lot_size,
    validate_model,
)


@dataclass
class PrivateTraining:
    optimizer: DPOptimizer
    sampler: PoissonSampler
    ledger: PrivacyLedger
    randomness: Randomness
    noise_multiplier: float
    sample_rate: float
    steps: int


def plan(
    *,
    dataset_size: int,
    lot_size: int,
    epochs: float,
    target_epsilon: float,
    target_delta: float,
    noise_multiplier: float | None = None,
    accountant: str = "pld",
    max_noise_multiplier: float | None = None,
    noise: str = "gaussian",
    prior_groups: Sequence[tuple[PrivacyEvent, int]] = (),
) -> tuple[float, float, int]:
    """(σ, q, steps) for a run. σ is calibrated to the budget unless given.

    ``noise="laplace"`` plans the Laplace form (σ is then b/C). ``prior_groups`` are the run's
    other releases (a DP-PCA projection), composed with the steps in the budget.

    With a given σ, the number of steps is min(epochs/q, the steps the budget allows); a
    budget that allows no step at all is an error. With ``max_noise_multiplier``, a budget
    that needs a larger σ for the planned steps is an error too: the noise would swamp the
    signal, and the fix is fewer epochs, a larger lot or a larger ε.
    """
    dataset_size = check_dataset_size(dataset_size)
    q = sample_rate_from_lot_size(lot_size, dataset_size)
    check_epsilon(target_epsilon)
    check_delta(target_delta, dataset_size=dataset_size)
    steps = calibration.steps_for_epochs(epochs, q)
    check_method_options(noise=noise, clip_norm_type="l1" if noise == "laplace" else "l2", accountant=accountant)
    kind = POISSON_LAPLACE if noise == "laplace" else POISSON_GAUSSIAN
    prior = list(prior_groups)
    if prior:
        # Unsampled Gaussian releases have an exact ε in closed form, a lower bound on any
        # accountant's: it refuses a prior that spends the budget without the accountant's
        # search, which takes minutes at a small σ.
        mu = analytic.gaussian_mu(positive_groups(prior))
        spent = analytic.gaussian_epsilon(mu, target_delta) if mu is not None else None
        if spent is None or spent < target_epsilon:
            spent = epsilon(prior, target_delta, accountant)
        if spent >= target_epsilon:
            raise DPConfigError(
                f"the run's other releases (DP-PCA) alone spend ε={spent:.4g} ≥ target_epsilon={target_epsilon}: "
                "nothing is left for training. Raise pca_noise_multiplier or target_epsilon."
            )
    if noise_multiplier is None:
        sigma = calibration.calibrate_noise_multiplier(
            target_epsilon, target_delta, q, steps, accountant, prior_groups=prior, kind=kind
        )
        if max_noise_multiplier is not None and sigma > max_noise_multiplier:
            raise DPConfigError(
                f"target_epsilon={target_epsilon} cannot be reached in {epochs:g} epochs ({steps} steps at "
                f"q={q:.4g}) with noise_multiplier ≤ {max_noise_multiplier:g}: it needs σ≈{sigma:.4g}. "
                "Train fewer epochs, use a larger lot, raise target_epsilon, or raise the limit "
                "(max_noise_multiplier) if you really want that much noise."
            )
    else:
        sigma = check_noise_multiplier(noise_multiplier)
        allowed = calibration.max_steps(
            sigma,
            q,
            target_epsilon,
            target_delta,
            accountant,
            prior_groups=prior,
            event=PrivacyEvent.of(kind, sigma, q),
        )
        if allowed == 0:
            raise DPConfigError(
                f"noise_multiplier={sigma} cannot take even one step within ε={target_epsilon} at "
                f"δ={target_delta} (q={q:.4g}). Raise noise_multiplier or target_epsilon, or leave "
                "noise_multiplier unset so that it is calibrated."
            )
        steps = min(steps, allowed)
    return sigma, q, steps


def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    *,
    dataset_size: int,
    lot_size: int,
    epochs: float,
    target_epsilon: float,
    target_delta: float,
    clip_norm: float,
    noise_multiplier: float | None = None,
    accountant: str = "pld",
    seed: int | None = None,
    physical_batch_size: int = 256,
    rank: int = 0,
    world_size: int = 1,
    reduce_fn: ReduceFn | None = None,
    epsilon_every: int | None = None,
    journal: str | None = None,
    clipping: str = "auto",
    prior_groups: Sequence[tuple[PrivacyEvent, int]] = (),
    **method_options: Any,
) -> PrivateTraining:
    """Validate everything, calibrate σ (unless given), and build sampler, ledger and optimizer.

    ``method_options`` are :class:`DPOptimizer`'s method arguments (``method``, ``ascent``,
    ``bam_variant``, ``noise``, ``clip_norm_type``, ``augment``, ``augmentation_multiplicity``,
    ``diagnostics``) and ``autocast`` ("bf16": the forward in bfloat16, clipping and noise in
    float32); they are checked before σ is calibrated. ``prior_groups`` are releases
    of the run made outside the training steps (a DP-PCA projection): σ is calibrated with them
    composed in, and the caller appends them to ``private.ledger`` (``dp_pca(ledger=...)``).

    ``clipping="auto"`` (default) uses book-keeping clipping where the model and method allow it
    (checked against vmap on the first lot, else vmap; ``private.optimizer.clipping`` says
    which), ``"vmap"`` always materialises per-example gradients. ``epsilon_every=None``
    (default) composes ε only when asked (``private.ledger.epsilon()``); the budget check is
    exact at every step either way.

    ``journal`` is the path of the ledger's append-only journal (see :class:`PrivacyLedger`);
    an existing journal is resumed. Only rank 0 keeps one. ``seed=None`` (default) is secure
    mode. In sharded use, each rank passes its ``rank``; it
    samples only its own shard and only rank 0 adds noise.
    """
    validate_model(model)
    check_clip_norm(clip_norm)
    if world_size > 1 and reduce_fn is None:
        raise DPConfigError(
            f"world_size={world_size} needs reduce_fn (an all-reduce SUM of the gradient sums across ranks): "
            "without it each rank would step on its own shard and ranks ≥ 1 would step without noise."
        )
    if journal is not None and rank != 0:
        raise DPConfigError(
            f"journal={journal!r} on rank {rank}: only rank 0 keeps the ledger's journal. Every rank records the "
            "same releases, so ranks sharing one journal would count each release once per rank; pass "
            "journal=None on ranks ≥ 1."
        )
    check_positive_int(physical_batch_size, "physical_batch_size")
    check_autocast(method_options.get("autocast", "none"))
    check_method_options(
        **{k: v for k, v in method_options.items() if k not in ("augment", "diagnostics", "autocast")},
        clipping=clipping,
        accountant=accountant,
    )
    sigma, q, steps = plan(
        dataset_size=dataset_size,
        lot_size=lot_size,
        epochs=epochs,
        target_epsilon=target_epsilon,
        target_delta=target_delta,
        noise_multiplier=noise_multiplier,
        accountant=accountant,
        noise=method_options.get("noise", "gaussian"),
        prior_groups=prior_groups,
    )
    return build_private(
        model,
        optimizer,
        loss_fn,
        noise_multiplier=sigma,
        sample_rate=q,
        steps=steps,
        dataset_size=dataset_size,
        target_epsilon=target_epsilon,
        target_delta=target_delta,
        clip_norm=clip_norm,
        accountant=accountant,
        randomness=make_randomness(seed),
        physical_batch_size=physical_batch_size,
        shard=shard_indices(dataset_size, rank, world_size),
        rank=rank,
        reduce_fn=reduce_fn,
        ledger=PrivacyLedger(target_epsilon, target_delta, accountant, epsilon_every=epsilon_every, journal=journal),
        clipping=clipping,
        **method_options,
    )


def build_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    *,
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    dataset_size: int,
    target_epsilon: float,
    target_delta: float,
    clip_norm: float,
    accountant: str,
    randomness: Randomness,
    ledger: PrivacyLedger,
    shard: torch.Tensor,
    rank: int = 0,
    reduce_fn: ReduceFn | None = None,
    physical_batch_size: int = 256,
    clipping: str = "vmap",
    **method_options: Any,
) -> PrivateTraining:
    """Build sampler and optimizer for an already planned run (σ, q, steps known).

    This is the worker-side half of :func:`make_private`: in sharded training σ is calibrated
    once on the driver and every rank builds its pieces from the plan. ``shard`` holds the
    indices this rank samples (its rows of the dataset); ``randomness`` is the run's root
    stream, from which the rank's sampling and noise streams are spawned. Only rank 0 adds
    noise; ranks ≥ 1 need ``reduce_fn``.
    """
    validate_model(model)
    if rank != 0 and reduce_fn is None:
        raise DPConfigError(f"rank={rank} needs reduce_fn: ranks ≥ 1 add no noise and must be all-reduced with rank 0.")
    if (
        ledger.target_delta != target_delta
        or ledger.accountant != accountant
        or ledger.target_epsilon != target_epsilon
    ):
        raise DPConfigError("the ledger was built for a different (ε, δ) or accountant than this run's plan.")
    sampler = PoissonSampler(shard, sample_rate, randomness.spawn("sampling", rank), steps)
    dp_optimizer = DPOptimizer(
        optimizer,
        model=model,
        loss_fn=loss_fn,
        noise_multiplier=noise_multiplier,
        clip_norm=clip_norm,
        sample_rate=sample_rate,
        dataset_size=dataset_size,
        randomness=randomness.spawn("noise", rank),
        ledger=ledger,
        physical_batch_size=physical_batch_size,
        add_noise=(rank == 0),
        reduce_fn=reduce_fn,
        clipping=clipping,
        **method_options,
    )
    return PrivateTraining(dp_optimizer, sampler, ledger, randomness, noise_multiplier, sample_rate, steps)
