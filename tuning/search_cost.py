"""What a whole sweep costs an example of the training split: a bound fixed before any data is seen.

Every trial trains on the same private training split, each calibrated to the target (ε, δ),
so the search as a whole spends more than any one trial. Without ``--private-selection`` the
choice of the winner is made on exact validation scores and is not accounted (the validation
split has no finite guarantee); the *training* split's cost is a composition of the trials,
bounded here without looking at any trial's result:

* Every trial runs one of finitely many mechanisms, each fixed by the config alone: for each
  lot size and epochs the space allows, the σ and q the platform calibrates
  (:func:`dpcore.plan`, with the run's own plan options and its DP-PCA release), and at most
  the number of releases its ledger allows at that σ (:func:`dpcore.max_steps`, which bounds a
  trial whose steps were re-released after a crash too). A pruned or failed trial releases a
  prefix of one of them.
* Each trial's RDP curve is then at most the pointwise maximum of those mechanisms' curves,
  whatever TPE, the pruner or a crash chose, and RDP composes under adaptive choice: K trials
  cost at most K × that maximum, converted to ε at the sweep's δ (dp_accounting's RDP).

K is fixed before the first trial: the sweep starts at most ``n_trials`` + ``max_failed_trials``
trials (complete, pruned, failed and retried ones alike: a retry is a trial of its own), so
the bound does not depend on how many trials happened to fail. A seeded sweep gives each trial
a seed of its own (:func:`tuning.trials.trial_seed`), so no two trials share their noise. The
bound exists only where the set of mechanisms is finite and RDP can account them: a lot size
or epochs searched over a range (not ``choices``), Laplace noise, or ``diagnostics`` (which
logs statistics without noise) gives none, and the reason is logged instead.

Composing the trials as they ran (their actual lot sizes and steps) gives a smaller number but
not a bound, since TPE chose later trials' settings from earlier trials' scores (Rogers et al.
2016); ``docs/benchmarks/sweep_cost.py`` prints both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import dpcore
from dpcore.accountants.rdp import quiet_absl
from dpcore.readout import epsilon_text

# options that change what a trial releases, besides the ones the plan reads
MECHANISM_OPTIONS = ("lot_size", "epochs")


@dataclass(frozen=True)
class Mechanism:
    """One mechanism a trial may run: lot size, epochs, σ, q, the most releases its ledger
    allows, and its prior releases (DP-PCA)."""

    lot_size: int
    epochs: float
    noise_multiplier: float
    sample_rate: float
    max_releases: int
    prior: tuple = ()

    def groups(self) -> list:
        step = dpcore.PrivacyEvent.of(dpcore.events.POISSON_GAUSSIAN, self.noise_multiplier, self.sample_rate)
        return [*self.prior, (step, self.max_releases)]


@dataclass(frozen=True)
class SearchBound:
    """The pointwise-maximum RDP curve of a sweep's mechanisms, at dp_accounting's orders."""

    mechanisms: tuple[Mechanism, ...]
    orders: tuple[float, ...]
    curve: tuple[float, ...]
    delta: float

    def epsilon(self, trials: int) -> float:
        """ε at the sweep's δ of ``trials`` trials, each any of the mechanisms, chosen adaptively."""
        from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

        if trials < 1:
            return 0.0
        eps, _ = compute_epsilon(list(self.orders), [trials * v for v in self.curve], self.delta)
        return float(eps)

    def describe(self, trials: int) -> str:
        return (
            f"ε ≤ {epsilon_text(self.epsilon(trials), '.4g')} at δ={self.delta:g} for the whole search ({trials} trials: every "
            f"trial the sweep could start, counted whether it ran, pruned or failed; each any of: {self.lots()}; RDP, "
            "data-independent)"
        )

    def lots(self) -> str:
        return ", ".join(
            f"lot {m.lot_size} × {m.epochs:g} epochs: σ={m.noise_multiplier:.4g}, q={m.sample_rate:.4g}, "
            f"≤ {m.max_releases} releases"
            for m in self.mechanisms
        )


@dataclass(frozen=True)
class StagedBound:
    """The bound of a later stage of a preset (the BAM appendix's stage 2), whose trials all ran
    with values an earlier stage chose on the validation split (its best lr and lot size). The
    stage's models depend on the earlier trials too, and which values were chosen depends on
    the data, so neither "this stage alone" nor "the stages as they ran" is a bound (Rogers et
    al.). ``own`` is this stage's curve widened to the worst over everything the earlier stages
    could have chosen (the pointwise maximum with their curves); ε composes the earlier stages'
    trials, each at its own curve, with this stage's at ``own``. Same methods as
    :class:`SearchBound`."""

    own: SearchBound
    prior: tuple[tuple[SearchBound, int], ...]

    @property
    def delta(self) -> float:
        return self.own.delta

    def epsilon(self, trials: int) -> float:
        return combined([*self.prior, (self.own, trials)])

    def describe(self, trials: int) -> str:
        before = " + ".join(f"{k} trials of an earlier stage" for _, k in self.prior)
        return (
            f"ε ≤ {epsilon_text(self.epsilon(trials), '.4g')} at δ={self.delta:g} for this stage and the stages whose "
            f"choice it started from ({before}, each counted whether it ran, pruned or failed, + {trials} trials of "
            f"this one, each any of the values the earlier stages could have chosen: {self.own.lots()}; RDP, "
            "data-independent)"
        )


def after(bound: SearchBound | str | None, prior) -> SearchBound | StagedBound | str | None:
    """``bound`` of a stage whose fixed values an earlier stage chose; ``prior``: those stages'
    ``(SearchBound or reason, K)``. Unchanged without ``prior``; a reason if any stage has none."""
    if not prior or bound is None or isinstance(bound, str):
        return bound
    if any(p is None or not isinstance(p[0], SearchBound) for p in prior):
        return "an earlier stage, whose choice this stage's fixed values are, has no bound"
    worst = bound.curve
    for b, _ in prior:
        if b.orders != bound.orders or b.delta != bound.delta:
            return "an earlier stage's bound is at other RDP orders or another δ"
        worst = tuple(max(a, c) for a, c in zip(worst, b.curve, strict=True))
    mechanisms = bound.mechanisms + tuple(m for b, _ in prior for m in b.mechanisms if m not in bound.mechanisms)
    own = SearchBound(mechanisms, bound.orders, worst, bound.delta)
    return StagedBound(own, tuple((b, int(k)) for b, k in prior))


def curve(groups, orders=None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(orders, RDP at each order) of ``groups`` ([(PrivacyEvent, count)]), by dp_accounting."""
    import dp_accounting

    acc = dp_accounting.rdp.RdpAccountant(list(orders)) if orders is not None else dp_accounting.rdp.RdpAccountant()
    with quiet_absl():
        acc.compose(dpcore.events.compose(groups))
    return tuple(float(o) for o in acc._orders), tuple(float(r) for r in acc._rdp)  # noqa: SLF001 - the curve itself


def mechanisms(base, space, dataset_size: int) -> tuple[Mechanism, ...] | str:
    """Every mechanism a trial of this sweep may run, or why they are not a finite set RDP can
    account. ``base``: the sweep's TrainConfig; ``space``: its :class:`tuning.space.SearchSpace`."""
    if base.noise != "gaussian":
        return f"noise={base.noise}: dp_accounting's RDP does not account it"
    if base.diagnostics:
        return "diagnostics: every trial also logs training statistics without noise"
    options = {}
    for name in MECHANISM_OPTIONS:
        p = space.get(name)
        if p is None:
            options[name] = [getattr(base, name)]
        elif p.choices is None:
            return (
                f"{name} is searched over a range, so the trials' mechanisms are not a finite set fixed in advance; "
                f"search it over choices for a bound"
            )
        else:
            options[name] = list(p.choices)
    prior = tuple(base.prior_groups())
    found = []
    for lot in options["lot_size"]:
        for epochs in options["epochs"]:
            cfg = dataclasses.replace(base, lot_size=int(lot), epochs=float(epochs))
            try:
                sigma, q, _ = dpcore.plan(dataset_size=dataset_size, prior_groups=list(prior), **cfg.plan_options())
            except dpcore.DPConfigError:
                continue  # a trial with these settings fails its plan, before any release
            most = dpcore.max_steps(
                sigma,
                q,
                cfg.target_epsilon,
                cfg.target_delta,
                cfg.accountant,
                prior_groups=list(prior),
                event=dpcore.PrivacyEvent.of(dpcore.events.POISSON_GAUSSIAN, sigma, q),
            )
            found.append(Mechanism(int(lot), float(epochs), float(sigma), float(q), int(most), prior))
    if not found:
        return "no lot size and epochs of the space can be planned at the target (ε, δ)"
    return tuple(found)


def search_bound(base, space, dataset_size: int) -> SearchBound | str:
    """The sweep's :class:`SearchBound`, or the reason it has none."""
    found = mechanisms(base, space, dataset_size)
    if isinstance(found, str):
        return found
    orders, worst = None, None
    for m in found:
        orders, c = curve(m.groups(), orders)
        worst = c if worst is None else tuple(max(a, b) for a, b in zip(worst, c, strict=True))
    return SearchBound(found, orders, worst, float(base.target_delta))


def summary(bound: SearchBound | str | None, trials: int) -> dict:
    """What a sweep reports of its bound: ``{"search_epsilon_bound": ε or None, "search_bound":
    the sentence, "search_trials": K}`` (ε None and the reason when there is no bound; empty
    with private selection, whose total is accounted instead)."""
    if bound is None:
        return {}
    if isinstance(bound, str):
        return {"search_epsilon_bound": None, "search_bound": f"none: {bound}", "search_trials": trials}
    return {
        "search_epsilon_bound": bound.epsilon(trials),
        "search_bound": bound.describe(trials),
        # every trial the bound covers: an earlier stage's too (a preset's stage 2)
        "search_trials": trials + sum(k for _, k in getattr(bound, "prior", ())),
    }


def log(client, run_id: str, bound: SearchBound | str | None, trials: int) -> dict:
    """The bound on a sweep's parent run: metric ``search_epsilon_bound`` and tags
    ``dp.search_epsilon_bound`` (the sentence) and ``dp.search_trials`` (K, the most trials the
    sweep starts). Returns :func:`summary`."""
    out = summary(bound, trials)
    if out:
        client.set_tag(run_id, "dp.search_epsilon_bound", out["search_bound"][:5000])
        if out["search_epsilon_bound"] is not None:
            client.log_metric(run_id, "search_epsilon_bound", out["search_epsilon_bound"])
            client.set_tag(run_id, "dp.search_trials", str(trials))
    return out


def combined(parts) -> float | None:
    """ε of several searches on the same training split together (a preset's stages): their
    curves, each times its K, summed order by order. ``parts``: [(SearchBound or reason, K)].
    None if any part has no bound."""
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    if not parts or any(p is None or not isinstance(p[0], SearchBound) for p in parts):
        return None
    orders, delta = parts[0][0].orders, parts[0][0].delta
    if any(b.orders != orders or b.delta != delta for b, _ in parts):
        return None
    total = [sum(k * b.curve[i] for b, k in parts) for i in range(len(orders))]
    eps, _ = compute_epsilon(list(orders), total, delta)
    return float(eps)
