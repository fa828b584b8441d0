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
* **A bound** (``--config``): data-independent, from the sweep's config alone. Every trial is
  one of finitely many mechanisms, fixed before any data is seen: for each lot size the space
  allows (and the config's fixed epochs), σ, q and T as the platform calibrates them
  (:func:`dpcore.plan`); a pruned trial releases a prefix of one. Each trial's RDP curve is at
  most their pointwise maximum whatever the sampler chose, and RDP composes under adaptive
  choice, so ``n_trials`` of that maximum bound the whole search (dp_accounting's RDP,
  converted at δ). It assumes no trial was retried (a retried trial adds one more) and that no
  step was re-released after a crash (check the trials' ledgers in MLflow: only committed
  releases, no more than the planned steps).

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

from tuning.space import SEARCHABLE


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


# searchable options that change no trial's mechanism once σ is calibrated to the target; the
# lot size and the epochs do, and an optimizer may change the kind of noise
PRIVACY_NEUTRAL = set(SEARCHABLE) - {"lot_size", "epochs", "optimizer"}
ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) + [128, 256, 512]


def bound_from_config(path: str, n: int) -> tuple[float, list[tuple]]:
    """The data-independent bound of the module docstring: ``n_trials`` × the pointwise maximum
    RDP curve over the mechanisms the config's space allows. Returns (ε, the mechanisms)."""
    import yaml
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    import dpcore

    cfg = yaml.safe_load(open(path))
    space = cfg.get("space") or {}
    unknown = set(space) - PRIVACY_NEUTRAL - {"lot_size"}
    if unknown:
        raise SystemExit(
            f"{path}: the space searches {sorted(unknown)}; this bound covers only lot_size besides {sorted(PRIVACY_NEUTRAL)}"
        )
    lots = space["lot_size"]["choices"] if "lot_size" in space else [cfg["lot_size"]]
    delta, curves, mechanisms = float(cfg["target_delta"]), [], []
    for lot in lots:
        sigma, q, steps = dpcore.plan(
            dataset_size=n,
            lot_size=int(lot),
            epochs=float(cfg["epochs"]),
            target_epsilon=float(cfg["target_epsilon"]),
            target_delta=delta,
        )
        acc = rdp_privacy_accountant.RdpAccountant(ORDERS)
        acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
        curves.append(acc._rdp)  # noqa: SLF001 - the RDP curve at ORDERS
        mechanisms.append((lot, q, sigma, steps))
    worst = [max(c[i] for c in curves) for i in range(len(ORDERS))]
    k = int(cfg["n_trials"])
    eps, _ = compute_epsilon(ORDERS, [k * v for v in worst], delta)
    return float(eps), mechanisms


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
        eps, mechanisms = bound_from_config(a.config, a.train_examples)
        for lot, q, sigma, steps in mechanisms:
            print(f"lot {lot}: q={q:.4f}, σ={sigma:.4f}, {steps} steps")
        print(
            f"{a.config}: the whole search, whatever the sampler chose: ε ≤ {eps:.2f} at its δ (RDP, data-independent)"
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
