"""A sweep's plan: everything that can fail, decided before its study or any MLflow run is
written. The search space (with the lot sizes that cannot meet the target taken out), the
private selection's accounting, the bound on the whole search's cost, and the Optuna storage,
once, on the driver (:func:`plan_sweep`); :func:`tuning.sweep.run_sweep` then only runs it."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dpcore
from pipelines import tracking

from . import search_cost, selection
from .config import SweepConfig, check_feasible, make_storage
from .space import SearchSpace, check_against, default_space, parse_space


@dataclass(frozen=True)
class SweepPlan:
    """One study's plan. ``base`` is the TrainConfig every trial shares (its paths absolute);
    ``sel`` the private selection's accounting (None without it); ``bound`` the search's cost
    to the training split without it (or the reason there is none)."""

    sweep: SweepConfig
    base: Any
    tracking_uri: str
    raw_space: dict
    space: SearchSpace
    train_rows: int
    sel: dict | None
    bound: Any
    storage: Any

    def fingerprint(self) -> str:
        """What a study is continued with: the space, the base config and the private
        selection's options. Another value for any of them is a different search."""
        sweep = self.sweep
        return json.dumps(
            {
                "space": self.raw_space,
                # (the memory budget is the machine's, not the search's: a study may go on elsewhere)
                "base": {k: v for k, v in self.base.to_dict().items() if k not in ("quiet", "memory_budget_mb")},
                "private_selection": sweep.private_selection,
                # K's distribution and the score's noise make the accounted total: a study goes on with the same
                **(
                    {k: getattr(sweep, k) for k in ("selection_mean", "selection_shape", "selection_noise_multiplier")}
                    if sweep.private_selection
                    else {}
                ),
            },
            sort_keys=True,
            default=str,
        )


def plan_sweep(
    sweep: SweepConfig, base, space_override: dict | None = None, fixed: dict | None = None, prior: list | None = None
) -> SweepPlan:
    """Check the sweep and its base config, prepare the data (and a public front end's
    features) once, and plan the search (see :func:`tuning.sweep.run_sweep` for the
    arguments). Raises :class:`dpcore.DPConfigError` with the reason; nothing is written to the
    study or to MLflow here."""
    from pipelines.models import build_run_model
    from pipelines.plan import check_shards, prepare_data, prepare_features, with_absolute_model

    sweep.validate()
    # A relative SQLite path would name a different file in each Ray worker (Ray Train runs
    # them in the run's own folder): resolve it here, once.
    sweep = dataclasses.replace(sweep, storage=tracking.resolve_tracking_uri(sweep.storage))
    if fixed:
        base = dataclasses.replace(base, **fixed)
    base.validate()
    tracking_uri = tracking.resolve_tracking_uri(base.tracking_uri)
    tracking.check_tracking_uri(tracking_uri)
    # Trials run in Ray tasks whose working folder may not be this one (a joined cluster):
    # every relative path of the base config (a local hf: model folder too) is made absolute here.
    base = with_absolute_model(
        dataclasses.replace(
            base,
            tracking_uri=tracking_uri,
            storage_path=str(Path(base.storage_path).expanduser().resolve()),
            data_dir=None if base.data_dir is None else str(Path(base.data_dir).expanduser().resolve()),
        )
    )
    data_dir, manifest = prepare_data(base)
    check_shards(base, data_dir, manifest)
    n = sum(e["rows"] for e in manifest["files"] if e["split"] == "train")
    if not sum(e["rows"] for e in manifest["files"] if e["split"] == "val"):
        raise dpcore.DPConfigError(
            "the sweep scores, prunes and chooses its trials on the validation split, and this dataset has none "
            f"(val_fraction={base.val_fraction:g}): every trial would train and have no score. Give it one "
            "(--val-fraction 0.1), or train without a sweep."
        )
    # A public front end's features (ScatterNet) are computed once here, not by the first trials at once.
    prepare_features(
        base, data_dir, manifest, build_run_model(base, tuple(manifest["input_shape"]), manifest["num_classes"])
    )
    raw_space, space = _space(sweep, base, space_override, n)
    sel = private_selection(sweep, base, space, n)
    # Without private selection: a bound on the whole search's cost to the training split,
    # fixed before any trial runs (or the reason there is none).
    bound = search_cost.search_bound(base, space, n) if sel is None else None
    bound = search_cost.after(bound, prior)  # a later stage: widened to the earlier stages' choices, composed with them
    # With private selection a trial whose process died is one of the K runs: not retried.
    storage = make_storage(sweep.storage, sweep if sel is None else dataclasses.replace(sweep, max_retry=0))
    return SweepPlan(sweep, base, tracking_uri, raw_space, space, n, sel, bound, storage)


def _space(sweep: SweepConfig, base, space_override: dict | None, n: int) -> tuple[dict, SearchSpace]:
    """The search space as given (``space_override``, the sweep's ``space:``, or the method's
    default) and parsed, checked against the base config, without the lot sizes that cannot
    meet the target (said on stderr)."""
    if space_override is not None:
        raw_space = space_override
    elif sweep.space is not None:
        raw_space = sweep.space
    else:
        raw_space = default_space(base.method, private_selection=sweep.private_selection is not None)
    space = parse_space(raw_space, n)
    if "lora_rank" in space.names and not base.lora_rank:
        raise dpcore.DPConfigError(
            "space: lora_rank is searched but the base config fine-tunes every weight (lora_rank=0, or not an hf: "
            "model); set --lora-rank (any r ≥ 1) on an hf: model to search LoRA's rank."
        )
    if "ascent" in space.names and base.method == "dpsgd":
        raise dpcore.DPConfigError(
            "space: ascent is searched but method='dpsgd' has no ascent step; set --method bam or dpsat."
        )
    check_against(space, base)
    lot_choices = check_feasible(base, space, n)
    if lot_choices is not None and len(lot_choices) < len(space.get("lot_size").choices):
        dropped = sorted(set(space.get("lot_size").choices) - set(lot_choices))
        print(
            f"[sweep] lot sizes {dropped} cannot meet ε={base.target_epsilon:g}; searching {lot_choices}",
            file=sys.stderr,
        )
        raw_space = {**raw_space, "lot_size": {"choices": lot_choices}}
        space = parse_space(raw_space, n)
    return raw_space, space


def private_selection(sweep: SweepConfig, base, space: SearchSpace, n: int) -> dict | None:
    """With ``--private-selection``: the selection's privacy event, its total ε and the one
    mechanism every trial runs (σ, q, steps); None without it. Raises where the search cannot
    be accounted (lot size or epochs searched, or a mechanism RDP cannot compose)."""
    if sweep.private_selection is None:
        return None
    searched = {"lot_size", "epochs"} & set(space.names)
    if searched:
        raise dpcore.DPConfigError(
            f"--private-selection needs every trial to be the same mechanism: take {', '.join(sorted(searched))} out of "
            "the search space ('space:') and fix it in the base config (every trial then has the same q, σ and steps); "
            "search lr, λ/ρ, the clip norm or the optimizer."
        )
    found = search_cost.mechanisms(base, space, n)  # lot size and epochs fixed: one mechanism
    if isinstance(found, str):
        raise dpcore.DPConfigError(f"--private-selection accounts the search by RDP, which cannot account it: {found}.")
    (mech,) = found
    event = selection.selection_event(
        selection.trial_event(mech.groups(), sweep.selection_noise_multiplier),
        sweep.selection_mean,
        sweep.private_selection,
        sweep.selection_shape,
    )
    return {
        "event": event,
        "total_epsilon": selection.total_epsilon(event, base.target_delta),
        "sigma": mech.noise_multiplier,
        "q": mech.sample_rate,
        "steps": mech.max_releases,
        "score_noise": sweep.selection_noise_multiplier,
    }
