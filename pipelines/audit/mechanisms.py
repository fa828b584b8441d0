"""Privacy audits of the platform's mechanisms: measure, then compare with the ledger's ε.

    dp-platform audit                                    # the main job with 1,000 gradient canaries (one run)
    dp-platform audit run.yaml --target-epsilon 8        # any training config
    dp-platform audit --mechanism dpsgd --workers 2      # the mechanism audit of one release

**One-run audit** (Steinke, Nasr and Jagielski 2023): ``dp-platform audit CONFIG`` trains with
``audit_canaries`` white-box gradient canaries (see :mod:`pipelines.train.canaries`, ``ensure_audit``,
and the worker loop): each canary is a parameter coordinate e_j, in the training data with
probability ½; a canary in the lot adds C·(1 − 10⁻⁴)·e_j (the clipping margin) to the clipped
sum, like any example; its score
is Σ_t ⟨released gradient_t, e_j⟩. The guesses and the bound are
:func:`dpcore.audit.one_run_audit`; the result goes to MLflow beside ``dp.epsilon``.

**Mechanism audit** (:func:`mechanism_audit`). One private release is run many times on
neighbouring inputs, through the real code path of each mechanism:

* ``dpsgd``, ``bam``, ``dpadam-laplace``: one step of :class:`dpcore.DPOptimizer` (vmap
  per-example gradients, clipping, the noise, the all-reduce with ``workers=2`` in two gloo
  processes, the division by qN) on a linear model whose per-example gradient is its input.
  The model has d parameters; the first c coordinates carry canaries: example j has input
  C·e_j (so its gradient is C·e_j), is in the dataset with probability ½, and is then
  Poisson-sampled at q. The score of coordinate j is coordinate j of the released (noised)
  gradient times qN. "In" scores are the coordinates of canaries in the dataset; "out"
  scores are every other coordinate, where no example of the dataset has any gradient: the
  situation of a canary left out. Noise that is independent across coordinates makes them
  independent draws, so one release gives c/2 "in" and d − c/2 "out" scores. BAM's ascent
  and Adam run as in training; the score is read from the noised gradient, before the base
  optimizer (post-processing).
* ``fedavg``: :meth:`dpcore.federated.ClientLevelDP.release` with d clients, of which the
  first c are canaries whose update 3S·e_j is clipped to S on the client
  (:func:`dpcore.federated.clip_update`); absent clients cannot be sampled. ``workers=2``
  forms the sum from two partial sums, as two actors do.
* ``pca``: :func:`dpcore.pca.release_gram` (DP-PCA's release; the eigendecomposition after it
  is post-processing) on canary rows e_j (j < c, each present with probability ½; one adds
  (1 − m)²·e_j e_jᵀ, m the clipping margin); the score of coordinate j is the released
  matrix's diagonal entry (j, j).

The scores go to :func:`dpcore.audit.distinguishing_epsilon_lower_bound`, and the claimed ε
of one release is the ledger's. A correct mechanism gives ε_lb ≤ ε; noise too small by √2
gives ε_lb > ε at the sizes the tests use.
"""

from __future__ import annotations

import math
import os
import socket
import tempfile
from dataclasses import dataclass

import torch
from torch import nn

import dpcore
from dpcore.audit import distinguishing_epsilon_lower_bound

from ..catalog import AUDIT_MECHANISMS

MECHANISMS = AUDIT_MECHANISMS


@dataclass(frozen=True)
class MechanismAudit:
    mechanism: str
    workers: int
    epsilon: float  # the ledger's ε of one release at δ
    epsilon_lower_bound: float
    delta: float
    confidence: float
    samples_in: int
    samples_out: int
    threshold: float


def _linear_loss(out, target):
    return out.sum()


def _scratch_ledger() -> dpcore.PrivacyLedger:
    """One ledger for all the audit's releases (each repetition is a separate experiment, so
    their composition means nothing): no budget, ε never computed per entry."""
    return dpcore.PrivacyLedger(None, 1e-5, epsilon_every=10**12)


def _membership(gen: torch.Generator, dim: int, canaries: int) -> torch.Tensor:
    inc = torch.zeros(dim, dtype=torch.bool)
    inc[:canaries] = torch.rand(canaries, generator=gen) < 0.5
    return inc


def _optimizer_scores(mechanism, dim, canaries, reps, sigma, q, clip, seed, rank=0, world=1, reduce_fn=None):
    """(scores, membership) over ``reps`` one-step runs of the DPOptimizer on canary inputs."""
    laplace = mechanism == "dpadam-laplace"
    rng = dpcore.SeededRandomness(seed)
    members = torch.Generator().manual_seed(seed)
    shard = dpcore.shard_indices(dim, rank, world)
    ledger = _scratch_ledger()
    scores, inside = [], []
    for r in range(reps):
        inc = _membership(members, dim, canaries)  # the same on every rank (same seed)
        model = nn.Linear(dim, 1, bias=False)
        base = torch.optim.Adam(model.parameters(), lr=1e-3) if laplace else torch.optim.SGD(model.parameters(), lr=0.1)
        options = {"noise": "laplace", "clip_norm_type": "l1"} if laplace else {}
        if mechanism == "bam":
            options = {"method": "bam", "ascent": 0.05}
        opt = dpcore.DPOptimizer(
            base,
            model=model,
            loss_fn=_linear_loss,
            noise_multiplier=sigma,
            clip_norm=clip,
            sample_rate=q,
            dataset_size=dim,
            randomness=rng.spawn("noise", r, rank),
            ledger=ledger,
            physical_batch_size=512,
            add_noise=(rank == 0),
            reduce_fn=reduce_fn,
            **options,
        )
        mine = shard[inc[shard]]  # this rank's canaries that are in the dataset
        lot = dpcore.PoissonSampler(mine, q, rng.spawn("sampling", r, rank), steps=1).sample()
        x = torch.zeros(len(lot), dim)
        x[torch.arange(len(lot)), lot] = clip
        if len(lot):
            opt.accumulate(x, torch.zeros(len(lot)))
        opt.step()
        scores.append(model.weight.grad.detach().flatten().double() * (q * dim))
        inside.append(inc)
    return torch.cat(scores), torch.cat(inside)


def _gloo_worker(rank, world, port, mechanisms, dim, canaries, reps, sigma, q, clip, seed, out_path):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)

    def all_reduce(tensors):
        for t in tensors:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)

    try:
        out = {
            m: _optimizer_scores(m, dim, canaries, reps, sigma, q, clip, seed, rank, world, all_reduce)
            for m in mechanisms
        }
        if rank == 0:
            torch.save(out, out_path)
        # Both ranks reach here before either tears the group down: a rank that destroyed it
        # while its peer's gloo threads were still at work was aborted now and then
        # ("terminate called without an active exception", about 1 run in 6 on a busy machine).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fedavg_scores(dim, canaries, reps, sigma, q, clip, seed, workers):
    from dpcore.federated import ClientLevelDP, clip_update

    rng = dpcore.SeededRandomness(seed)
    members = torch.Generator().manual_seed(seed)
    m = q * dim
    ledger = _scratch_ledger()
    probe = torch.zeros(dim)
    probe[0] = 3.0 * clip
    clipped_value = float(clip_update(probe, clip)[0][0])  # what the client sends: S(1 − m), m = CLIP_MARGIN
    scores, inside = [], []
    for r in range(reps):
        inc = _membership(members, dim, canaries)
        dp = ClientLevelDP(dim, m, sigma, clip, ledger, rng.spawn(r))
        sampled = [int(k) for k in dp.sample_clients() if inc[k]]  # absent clients cannot be sampled
        parts = [torch.zeros(dim, dtype=torch.float64) for _ in range(workers)]
        for i in range(workers):  # dealt out as the pipeline deals clients to actors
            mine = torch.tensor(sampled[i::workers], dtype=torch.long)
            parts[i][mine] = clipped_value  # each canary client's update 3S·e_k, clipped to S
        total = sum(parts)
        scores.append(dp.release(total, count=len(sampled)).double() * m)
        inside.append(inc)
    return torch.cat(scores), torch.cat(inside)


def _pca_scores(dim, canaries, reps, sigma, q, seed):
    rng = dpcore.SeededRandomness(seed)
    members = torch.Generator().manual_seed(seed)
    ledger = _scratch_ledger()
    scores, inside = [], []
    for r in range(reps):
        inc = _membership(members, dim, canaries)
        rows = torch.eye(dim)[inc]
        if len(rows) == 0:
            rows = torch.zeros(1, dim)
        released, _ = dpcore.pca.release_gram(rows, sigma, rng.spawn(r), ledger=ledger, sample_rate=q)
        scores.append(torch.diagonal(released).clone())
        inside.append(inc)
    return torch.cat(scores), torch.cat(inside)


def mechanism_scores(
    mechanism,
    *,
    dim: int,
    canaries: int,
    repetitions: int,
    noise_multiplier: float,
    sample_rate: float = 1.0,
    clip_norm: float = 1.0,
    seed: int = 0,
    workers: int = 1,
):
    """The coordinates' scores and canary membership over ``repetitions`` independent releases.
    ``mechanism`` may be a list of optimizer mechanisms: with 2 workers they then share one
    pair of gloo processes, and a dict {mechanism: (scores, membership)} is returned."""
    if isinstance(repetitions, bool) or not isinstance(repetitions, int) or repetitions < 1:
        raise dpcore.DPConfigError(f"repetitions={repetitions!r}: the audit needs at least one release (≥ 1).")
    if not (0 < canaries <= dim):
        raise dpcore.DPConfigError(
            f"canaries={canaries} must lie in [1, dim={dim}]: each canary has a coordinate of its own."
        )
    many = isinstance(mechanism, (list, tuple))
    for m in mechanism if many else [mechanism]:
        if m not in MECHANISMS:
            raise dpcore.DPConfigError(f"mechanism={m!r} is unknown; use one of {', '.join(MECHANISMS)}.")
    if workers not in (1, 2):
        raise dpcore.DPConfigError(f"workers={workers}: the mechanism audit runs with 1 or 2 workers.")
    common = (dim, canaries, repetitions, noise_multiplier, sample_rate, clip_norm, seed)
    if not many:
        return _scores_of(mechanism, workers, *common)
    if workers == 2 and all(m in ("dpsgd", "bam", "dpadam-laplace") for m in mechanism):
        return _spawn_two(list(mechanism), *common)
    return {m: _scores_of(m, workers, *common) for m in mechanism}


def _scores_of(mechanism, workers, dim, canaries, repetitions, noise_multiplier, sample_rate, clip_norm, seed):
    if mechanism == "fedavg":
        return _fedavg_scores(dim, canaries, repetitions, noise_multiplier, sample_rate, clip_norm, seed, workers)
    if mechanism == "pca":
        if workers != 1:
            raise dpcore.DPConfigError("DP-PCA runs on the driver alone: audit it with workers=1.")
        return _pca_scores(dim, canaries, repetitions, noise_multiplier, sample_rate, seed)
    if workers == 1:
        return _optimizer_scores(mechanism, dim, canaries, repetitions, noise_multiplier, sample_rate, clip_norm, seed)
    return _spawn_two([mechanism], dim, canaries, repetitions, noise_multiplier, sample_rate, clip_norm, seed)[
        mechanism
    ]


def _spawn_two(mechanisms, dim, canaries, repetitions, noise_multiplier, sample_rate, clip_norm, seed) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "scores.pt")
        mp.spawn(
            _gloo_worker,
            args=(
                2,
                _free_port(),
                mechanisms,
                dim,
                canaries,
                repetitions,
                noise_multiplier,
                sample_rate,
                clip_norm,
                seed,
                out,
            ),
            nprocs=2,
            join=True,
        )
        return torch.load(out)


def claimed_epsilon(mechanism: str, noise_multiplier: float, sample_rate: float, delta: float) -> float:
    """The ledger's ε for one release of ``mechanism``."""
    if mechanism == "dpadam-laplace":
        kind = dpcore.events.POISSON_LAPLACE
    elif mechanism == "pca" and sample_rate == 1.0:
        kind = dpcore.events.GAUSSIAN
    else:
        kind = dpcore.events.POISSON_GAUSSIAN
    ledger = dpcore.PrivacyLedger(None, delta)
    ledger.append(dpcore.PrivacyEvent.of(kind, noise_multiplier, sample_rate), step=1, clip_norm=1.0)
    return ledger.epsilon()


def mechanism_audits(mechanisms, *, noise_multipliers: dict | None = None, **kw) -> list[MechanismAudit]:
    """:func:`mechanism_audit` for several mechanisms; with ``workers=2`` the optimizer
    mechanisms share one pair of processes. ``noise_multipliers`` maps mechanism → σ."""
    sigmas = noise_multipliers or {}
    groups: dict = {}
    for m in mechanisms:
        groups.setdefault(sigmas.get(m, kw.get("noise_multiplier", 1.5)), []).append(m)
    out = {}
    for sigma, ms in groups.items():
        args = {**kw, "noise_multiplier": sigma}
        scores = mechanism_scores(ms, **{k: v for k, v in args.items() if k not in ("delta", "confidence")})
        for m in ms:
            out[m] = _bound(
                m,
                *scores[m],
                sigma,
                args.get("sample_rate", 1.0),
                args.get("delta", 1e-3),
                args.get("confidence", 0.95),
                args.get("seed", 0),
                args.get("workers", 1),
            )
    return [out[m] for m in mechanisms]


def _bound(mechanism, s, inc, sigma, q, delta, confidence, seed, workers) -> MechanismAudit:
    res = distinguishing_epsilon_lower_bound(s[inc].numpy(), s[~inc].numpy(), delta, confidence, seed=seed)
    eps = claimed_epsilon(mechanism, sigma, q, delta)
    return MechanismAudit(
        mechanism,
        workers,
        eps,
        res.epsilon_lower_bound,
        delta,
        confidence,
        res.samples_in,
        res.samples_out,
        res.threshold if math.isfinite(res.threshold) else float("nan"),
    )


def mechanism_audit(
    mechanism: str,
    *,
    dim: int = 2000,
    canaries: int = 400,
    repetitions: int = 500,
    noise_multiplier: float = 1.5,
    sample_rate: float = 1.0,
    delta: float = 1e-3,
    confidence: float = 0.95,
    seed: int = 0,
    workers: int = 1,
) -> MechanismAudit:
    """Run the mechanism audit and return ε_lb beside the ledger's ε (see the module doc)."""
    options = {k: v for k, v in locals().items() if k != "mechanism"}  # the keywords above, as given
    return mechanism_audits([mechanism], **options)[0]
