"""The search space of a sweep: what Optuna may choose for each trial.

Defaults (the BAM appendix's searches): the learning rate on a log scale, the expected lot
size as a power of two (or an integer on a log scale), and, for ``method=bam``/``dpsat``, the
ascent radius λ/ρ on a log scale. Optional: epochs, the clip norm C and the optimizer. Every
other option is the sweep's base config, the same for every trial. (ε, δ) are never searched:
each trial calibrates σ for its own lot size and epochs, and its ledger proves ε ≤ target.

In YAML (``space:`` in the sweep file), each entry is one of

    lr: {low: 1.0e-3, high: 0.1, log: true}
    lot_size: {choices: [128, 256, 512]}          # or {low: 64, high: 1024, log: true} (integers)
    ascent: {low: 1.0e-3, high: 0.2, log: true}
    optimizer: {choices: [adam, nadam]}
    lora_rank: {choices: [4, 8, 16]}              # hf: models with LoRA (or {low: 2, high: 32, log: true})
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import dpcore

SEARCHABLE = ("lr", "lot_size", "ascent", "epochs", "clip_norm", "optimizer", "momentum", "lora_rank")
INT_PARAMS = ("lot_size", "lora_rank")
CATEGORICAL_ONLY = ("optimizer",)


@dataclass(frozen=True)
class Param:
    name: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    choices: tuple | None = None

    def suggest(self, trial) -> Any:
        if self.choices is not None:
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.name in INT_PARAMS:
            return trial.suggest_int(self.name, int(self.low), int(self.high), log=self.log)
        return trial.suggest_float(self.name, float(self.low), float(self.high), log=self.log)

    def values_at_extremes(self) -> list:
        if self.choices is not None:
            return list(self.choices)
        return [self.low, self.high]

    def describe(self) -> str:
        if self.choices is not None:
            return f"{self.name} ∈ {{{', '.join(map(str, self.choices))}}}"
        return f"{self.name} ∈ [{self.low:g}, {self.high:g}]{' (log)' if self.log else ''}"


@dataclass(frozen=True)
class SearchSpace:
    params: tuple[Param, ...] = field(default_factory=tuple)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.params]

    def get(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)

    def suggest(self, trial) -> dict[str, Any]:
        return {p.name: p.suggest(trial) for p in self.params}

    def describe(self) -> str:
        return "; ".join(p.describe() for p in self.params)


def default_space(method: str = "dpsgd", private_selection: bool = False) -> dict:
    """The BAM appendix's searches: lr and lot size for DP-SGD; λ (BAM) or ρ (DP-SAT) on top.
    With private selection every trial is one mechanism, so the lot size is the base config's."""
    space: dict[str, dict] = {"lr": {"low": 1e-3, "high": 0.3, "log": True}}
    if not private_selection:
        space["lot_size"] = {"choices": [64, 128, 256, 512, 1024]}
    if method == "bam":
        space["ascent"] = {"low": 1e-3, "high": 0.2, "log": True}
    elif method == "dpsat":
        space["ascent"] = {"low": 1e-3, "high": 0.5, "log": True}
    return space


def parse_space(raw: Any, dataset_size: int | None = None) -> SearchSpace:
    """A :class:`SearchSpace` from the YAML mapping, checked: names, ranges, and lot sizes ≤ N."""
    err = dpcore.DPConfigError
    if not isinstance(raw, dict) or not raw:
        raise err(
            "the search space is empty: give at least one of "
            f"{', '.join(SEARCHABLE)} under 'space:' (or leave 'space:' out for the default lr × lot_size search)."
        )
    params = []
    for name, spec in raw.items():
        if name not in SEARCHABLE:
            raise err(
                f"space: {name!r} cannot be searched; searchable: {', '.join(SEARCHABLE)}. (ε and δ are fixed for the whole sweep.)"
            )
        if isinstance(spec, (list, tuple)):
            spec = {"choices": list(spec)}
        if not isinstance(spec, dict):
            raise err(
                f"space: {name} must be a mapping such as {{low: .., high: .., log: true}} or {{choices: [..]}}, not {spec!r}."
            )
        unknown = set(spec) - {"low", "high", "log", "choices"}
        if unknown:
            raise err(f"space: {name} has unknown keys {sorted(unknown)}; use low, high, log or choices.")
        if "choices" in spec:
            choices = spec["choices"]
            if not isinstance(choices, (list, tuple)) or not choices:
                raise err(f"space: {name}.choices must be a non-empty list.")
            if name in INT_PARAMS and not all(
                isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in choices
            ):
                raise err(f"space: {name}.choices must be positive integers, not {choices}.")
            p = Param(name, choices=tuple(choices))
        else:
            if name in CATEGORICAL_ONLY:
                raise err(f"space: {name} takes choices, e.g. {{choices: [adam, nadam]}}.")
            if "low" not in spec or "high" not in spec:
                raise err(f"space: {name} needs low and high (or choices).")
            low, high, log = spec["low"], spec["high"], bool(spec.get("log", False))
            for v in (low, high):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise err(f"space: {name} bounds must be numbers, not {v!r}.")
            if not low < high:
                raise err(
                    f"space: {name} needs low < high (got {low}, {high}); to fix a value, set it in the base config instead."
                )
            if log and low <= 0:
                raise err(f"space: {name} on a log scale needs low > 0 (got {low}).")
            if name == "ascent" and low < 0:
                raise err(f"space: ascent (λ/ρ) must be ≥ 0 (got low={low}).")
            if name in ("lr", "epochs", "clip_norm") and low <= 0:
                raise err(f"space: {name} must be > 0 (got low={low}).")
            if name in INT_PARAMS and (low < 1 or low != int(low) or high != int(high)):
                raise err(f"space: {name} takes whole numbers ≥ 1 (got low={low}, high={high}).")
            p = Param(name, low=low, high=high, log=log)
        params.append(p)
    space = SearchSpace(tuple(params))
    lot = space.get("lot_size")
    if lot is not None and dataset_size is not None:
        too_big = [v for v in lot.values_at_extremes() if v > dataset_size]
        if too_big:
            raise err(
                f"space: lot_size reaches {max(too_big)}, beyond the {dataset_size} training examples; "
                f"keep lot sizes ≤ N (q = L/N ≤ 1)."
            )
    return space


def check_against(space: SearchSpace, base) -> None:
    """Every value the space can give a trial must make a valid training config with ``base``:
    a trial whose config is refused fails after the sweep has started (each choice, and both
    ends of each range, are checked here instead, before the study or any run is written)."""
    import dataclasses

    for p in space.params:
        for v in p.values_at_extremes():
            value = int(v) if p.name in INT_PARAMS else v
            try:
                dataclasses.replace(base, **{p.name: value}).validate()
            except dpcore.DPConfigError as e:
                raise dpcore.DPConfigError(f"space: {p.name}={value!r} would make every such trial fail: {e}") from None
