"""The PLD accountant (default): privacy-loss distributions from Google's ``dp_accounting``.

Building the PLD of one subsampled mechanism is the expensive part (≈0.1–0.5 s); it is cached
per event and grid, and self-composed for a count, which gives the same numbers as
``dp_accounting.pld.PLDAccountant`` (same construction, same pessimistic discretisation).
An event kind without a cached construction is composed by ``PLDAccountant`` itself.
"""

from __future__ import annotations

import functools
import math

from .._lazy import LazyModule
from ..events import Gaussian, Laplace, PoissonGaussian, PoissonLaplace, PrivacyEvent

dp_accounting = LazyModule("dp_accounting")  # imported on first use (dpcore._lazy)
_pld = LazyModule("dp_accounting.pld.privacy_loss_distribution")

VALUE_DISCRETIZATION = 1e-4  # dp_accounting's default for PLDAccountant
# Searches (calibration, the largest count that fits) run on a 10× coarser grid, about ten
# times faster; every answer is then checked, and corrected, on the fine grid above.
SEARCH_DISCRETIZATION = 1e-3


_HANDED: dict = {}  # (event, grid) → a PLD another process built (import_base_plds)


@functools.lru_cache(maxsize=256)
def base_pld(event: PrivacyEvent, vdi: float):
    """The PLD of one release of ``event`` on the grid ``vdi`` (None: not cached here)."""
    handed = _HANDED.pop((event, float(vdi)), None)
    if handed is not None:
        return handed
    if isinstance(event, PoissonGaussian):
        return _pld.from_gaussian_mechanism(
            standard_deviation=event.noise_multiplier,
            sampling_prob=event.sample_rate,
            value_discretization_interval=vdi,
        )
    if isinstance(event, PoissonLaplace):
        return _pld.from_laplace_mechanism(
            parameter=event.noise_multiplier, sampling_prob=event.sample_rate, value_discretization_interval=vdi
        )
    if isinstance(event, Laplace):
        return _pld.from_laplace_mechanism(parameter=event.noise_multiplier, value_discretization_interval=vdi)
    return None


def export_base_plds(events, vdi: float = VALUE_DISCRETIZATION) -> list:
    """(event, grid, PLD of one release) for each of ``events`` that has a cached construction,
    built here if it is not yet: for another process that accounts for the same events
    (:func:`import_base_plds`). The driver hands its workers the PLDs it built while planning,
    so that a worker's first release does not wait for the same construction (1.4–1.6 s of one
    core for the Fashion-MNIST step's PLD, measured 2026-11-26)."""
    built = [(e, float(vdi), base_pld(e, vdi)) for e in events]
    return [item for item in built if item[2] is not None]


def import_base_plds(items) -> None:
    """Use the PLDs of :func:`export_base_plds` for those events and grids from now on (where
    this process has not built its own yet). They are what this process would have built: the
    construction is deterministic, and pickling keeps every float."""
    for event, vdi, pld in items:
        _HANDED[(event, float(vdi))] = pld


def _part(event: PrivacyEvent, count: int, vdi: float):
    if isinstance(event, Gaussian):  # dp_accounting folds the count into σ/√count: exact
        return _pld.from_gaussian_mechanism(
            standard_deviation=event.noise_multiplier / math.sqrt(count), value_discretization_interval=vdi
        )
    base = base_pld(event, vdi)
    if base is not None:
        return base.self_compose(count)
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=vdi)
    acc.compose(event.to_dp_event(), count)
    return acc._pld  # noqa: SLF001 - dp_accounting exposes the composed PLD only this way


def composed(groups, vdi: float):
    """The PLD of every release in ``groups`` (positive counts), composed."""
    total = _pld.identity(value_discretization_interval=vdi)
    for event, count in groups:
        total = total.compose(_part(event, int(count), vdi))
    return total


class PLD:
    """PLD accounting on a grid of ``value_discretization_interval`` (searches: 10× coarser)."""

    name = "pld"

    def __init__(self, value_discretization_interval: float = VALUE_DISCRETIZATION):
        self.vdi = float(value_discretization_interval)

    def epsilon(self, groups, delta: float, *, coarse: bool = False) -> float:
        vdi = max(self.vdi, SEARCH_DISCRETIZATION) if coarse else self.vdi
        return float(composed(groups, vdi).get_epsilon_for_delta(delta))

    def delta(self, groups, epsilon: float) -> float:
        return float(composed(groups, self.vdi).get_delta_for_epsilon(epsilon))
