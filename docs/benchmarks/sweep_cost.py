"""What a hyperparameter search cost in privacy, for an example of the training split.

Every trial of `dp-platform sweep` trains on the same private training split, each at the
target (ε, δ). The released result (the best trial's model and which trial won) is a
post-processing of the trials' models and of the validation split, so for an example of the
training split its cost is a composition of the trials. Two numbers:

* **As they ran** (``--storage``/``--study`` or ``--json``): every trial's σ, Poisson rate
  q = lot size / N and steps (a pruned trial up to where it stopped), composed with
  dp_accounting (PLD, and RDP beside it). This is *not* a formal bound: TPE and the pruner
  chose each later trial's lot size and length from earlier trials' validation scores, and
  composing mechanisms whose privacy parameters were chosen adaptively, as they turned out,
  is not covered by the composition theorems (Rogers et al. 2016, "Privacy odometers and
  filters"). Read it as what the search would cost had those settings been fixed in advance.
* **A bound** (``--config``): data-independent, from the sweep's config alone, as
  ``dp-platform sweep`` itself logs it on the parent run (``search_epsilon_bound``;
  :mod:`tuning.search_cost`). Every trial is one of finitely many mechanisms, fixed before any
  data is seen: for each lot size and epochs the space allows, σ and q as the platform
  calibrates them and at most the releases its ledger allows at that σ; a pruned trial
  releases a prefix of one. Each trial's RDP curve is at most their pointwise maximum whatever
  the sampler chose, and RDP composes under adaptive choice, so K of that maximum bound the
  whole search (dp_accounting's RDP, converted at δ): K = n_trials + max_failed_trials, the
  most trials the sweep starts (what it logs), and K = n_trials for a sweep that started
  exactly n_trials (none failed or was retried).

For an example of the validation split there is no finite guarantee either way: the winner is
chosen on an exact count. ``--private-selection`` gives an accounted search instead (docs/sweeps.md).

    python docs/benchmarks/sweep_cost.py --storage sqlite:///optuna.db --study NAME --train-examples N
    python docs/benchmarks/sweep_cost.py --json docs/results/fashion-mnist-sweep.json --train-examples N
    python docs/benchmarks/sweep_cost.py --config configs/spamassassin-sweep.yaml --train-examples N
"""

from __future__ import annotations

import argparse
import json

import dp_accounting
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant


def trials_from_optuna(storage: str, study: str) -> list[dict]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    s = optuna.load_study(study_name=study, storage=storage)
    return [
        {"number": t.number, "state": t.state.name, "params": t.params, **t.user_attrs}
        for t in s.trials
        if "steps" in t.user_attrs
    ]


def trials_from_json(path: str) -> list[dict]:
    return [t for t in json.load(open(path))["trials"] if "steps" in t]


def event(trials: list[dict], n: int) -> dp_accounting.DpEvent:
    """Every trial: ``steps`` Poisson-sampled Gaussian releases at its σ and q = lot / n."""
    return dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(
                    t["params"]["lot_size"] / n, dp_accounting.GaussianDpEvent(t["noise_multiplier"])
                ),
                int(t["steps"]),
            )
            for t in trials
            if int(t["steps"]) > 0
        ]
    )


def bound_from_config(path: str, n: int):
    """The data-independent bound of the module docstring, as ``dp-platform sweep`` logs it
    (:mod:`tuning.search_cost`): (the bound, or the reason there is none; n_trials)."""
    from tuning.cli import load_sweep_config
    from tuning.search_cost import search_bound
    from tuning.space import default_space, parse_space

    sweep, base = load_sweep_config(path, {})
    space = parse_space(sweep.space if sweep.space is not None else default_space(base.method), n)
    return search_bound(base, space, n), sweep.n_trials, sweep.max_failed_trials


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--storage", help="the sweep's Optuna storage URL")
    p.add_argument("--study", help="the study's name")
    p.add_argument("--json", help="a results file with a 'trials' list (docs/results/*-sweep.json)")
    p.add_argument("--config", help="the sweep's YAML config: the data-independent bound")
    p.add_argument("--train-examples", type=int, required=True, help="N, the size of the training split")
    p.add_argument("--delta", type=float, default=1e-5)
    a = p.parse_args()
    if a.config:
        bound, k, failures = bound_from_config(a.config, a.train_examples)
        if isinstance(bound, str):
            raise SystemExit(f"{a.config}: no data-independent bound: {bound}")
        for m in bound.mechanisms:
            print(
                f"lot {m.lot_size} × {m.epochs:g} epochs: q={m.sample_rate:.4f}, σ={m.noise_multiplier:.4f}, "
                f"at most {m.max_releases} releases"
            )
        print(
            f"{a.config}: the whole search, whatever the sampler chose: ε ≤ {bound.epsilon(k + failures):.2f} at "
            f"δ={bound.delta:g} for the {k + failures} trials the sweep may start (n_trials + max_failed_trials, "
            f"as it logs it); ε ≤ {bound.epsilon(k):.2f} where exactly {k} were started (RDP, data-independent)"
        )
        return
    trials = trials_from_json(a.json) if a.json else trials_from_optuna(a.storage, a.study)
    print("| trial | state | lot | q | σ | steps | ε of the trial alone |")
    print("|---|---|---|---|---|---|---|")
    for t in trials:
        print(
            f"| {t['number']} | {t['state']} | {t['params']['lot_size']} | {t['params']['lot_size'] / a.train_examples:.4f} "
            f"| {t['noise_multiplier']:.4f} | {t['steps']} | {t.get('epsilon', float('nan')):.4f} |"
        )
    ev = event(trials, a.train_examples)
    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
    pld.compose(ev)
    rdp = rdp_privacy_accountant.RdpAccountant()
    rdp.compose(ev)
    print(
        f"{len(trials)} trials composed as they ran (not a bound: their settings were chosen adaptively), "
        f"N={a.train_examples}, δ={a.delta:g}: ε = {pld.get_epsilon(a.delta):.2f} (dp_accounting PLD), "
        f"{rdp.get_epsilon(a.delta):.2f} (RDP)"
    )


if __name__ == "__main__":
    main()
