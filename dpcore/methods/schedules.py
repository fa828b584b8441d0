"""λ (BAM) and ρ (DP-SAT) over a run: public schedules of the 0-based step, free of privacy cost."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import DPConfigError
from .options import ASCENT_SCHEDULES, AscentArg, Schedule, check_method_options


def ascent_schedule(
    value: float, kind: str = "constant", total_steps: int | None = None, warmup_fraction: float = 0.1
) -> Schedule:
    """λ (or ρ) as a function of the 0-based step: ``constant``; ``warmup``: linear from 0 to
    ``value`` over the first ``warmup_fraction`` of the steps, then constant; ``cosine``: from
    ``value`` down to 0 over the run. Public (data-independent), so free of privacy cost."""
    check_method_options(ascent=value)
    if kind not in ASCENT_SCHEDULES:
        raise DPConfigError(f"ascent schedule {kind!r} is unknown; choose one of {', '.join(ASCENT_SCHEDULES)}.")
    value = float(value)
    if kind == "constant":
        return AscentSchedule("constant", value)
    if total_steps is None or total_steps < 1:
        raise DPConfigError(f"the {kind!r} ascent schedule needs the run's total number of steps.")
    if kind == "warmup":
        if not (0 < warmup_fraction <= 1):
            raise DPConfigError(f"warmup_fraction={warmup_fraction} must lie in (0, 1].")
        return AscentSchedule("warmup", value, max(1, int(round(warmup_fraction * total_steps))))
    return AscentSchedule("cosine", value, total_steps)


@dataclass(frozen=True)
class AscentSchedule:
    """λ or ρ at a 0-based step: ``constant``, ``warmup`` (linear from 0 over ``steps``) or
    ``cosine`` (from ``value`` down to 0 over ``steps``)."""

    kind: str
    value: float
    steps: int = 1

    def __call__(self, step: int) -> float:
        if self.kind == "warmup":
            return self.value * min(1.0, step / self.steps)
        if self.kind == "cosine":
            return 0.5 * self.value * (1.0 + math.cos(math.pi * min(step, self.steps) / self.steps))
        return self.value

    def __repr__(self) -> str:
        return (
            f"constant({self.value:g})"
            if self.kind == "constant"
            else f"{self.kind}({self.value:g}, {self.steps} steps)"
        )


def as_schedule(ascent: AscentArg) -> Schedule:
    return ascent if callable(ascent) else AscentSchedule("constant", float(ascent))
