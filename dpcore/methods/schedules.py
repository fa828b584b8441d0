"""λ (BAM) and ρ (DP-SAT) over a run: public schedules of the 0-based step, free of privacy cost."""

from __future__ import annotations

import math

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
        return _Constant(value)
    if total_steps is None or total_steps < 1:
        raise DPConfigError(f"the {kind!r} ascent schedule needs the run's total number of steps.")
    if kind == "warmup":
        if not (0 < warmup_fraction <= 1):
            raise DPConfigError(f"warmup_fraction={warmup_fraction} must lie in (0, 1].")
        return _Warmup(value, max(1, int(round(warmup_fraction * total_steps))))
    return _Cosine(value, total_steps)


class _Constant:
    def __init__(self, value: float):
        self.value = value

    def __call__(self, step: int) -> float:
        return self.value

    def __repr__(self) -> str:
        return f"constant({self.value:g})"


class _Warmup:
    def __init__(self, value: float, steps: int):
        self.value, self.steps = value, steps

    def __call__(self, step: int) -> float:
        return self.value * min(1.0, step / self.steps)

    def __repr__(self) -> str:
        return f"warmup({self.value:g}, {self.steps} steps)"


class _Cosine:
    def __init__(self, value: float, total: int):
        self.value, self.total = value, total

    def __call__(self, step: int) -> float:
        return 0.5 * self.value * (1.0 + math.cos(math.pi * min(step, self.total) / self.total))

    def __repr__(self) -> str:
        return f"cosine({self.value:g}, {self.total} steps)"


def as_schedule(ascent: AscentArg) -> Schedule:
    return ascent if callable(ascent) else _Constant(float(ascent))
