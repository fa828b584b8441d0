"""The PLD accountant (default): privacy-loss distributions from Google's ``dp_accounting``.

Building the PLD of one subsampled mechanism is the expensive part (≈0.1–0.5 s); it is cached
per event and grid, and self-composed for a count, which gives the same numbers as
``dp_accounting.pld.PLDAccountant`` (same construction, same pessimistic discretisation).
An event kind without a cached construction is composed by ``PLDAccountant`` itself.

The grid is dp_accounting's 1e-4 unless one release's privacy loss spans more than
``MAX_GRID_POINTS`` of it (σ below about 0.12, where one step alone spends ε ≳ 50): the span
grows as 1/σ², and at σ = 0.02 one release's PLD took 140 s and 3.7 GB to build, at σ = 10⁻³
38 GiB. Such a history is composed on a coarser grid that holds the widest span in that many
points (one grid for all its events; a release on the whole dataset spans more with each
repeat, σ/√k): still an upper bound on ε (the pessimistic discretisation holds on any grid);
at σ = 0.12, q = 0.01 it gave 55.020437161 where the 1e-4 grid gives 55.020437159 (helper-7's
review). A σ so small that even a 1-nat grid cannot hold one release (σ ≲ 10⁻³, or b < 1/709
for a sampled Laplace, whose bounds overflow) is refused with :class:`~dpcore.DPConfigError` by
:meth:`PLD.check`, which the ledger calls before anything is drawn.
"""

from __future__ import annotations

import functools
import math

from .._lazy import LazyModule
from ..errors import DPConfigError
from ..events import Gaussian, Laplace, PoissonGaussian, PoissonLaplace, PrivacyEvent

dp_accounting = LazyModule("dp_accounting")  # imported on first use (dpcore._lazy)
_pld = LazyModule("dp_accounting.pld.privacy_loss_distribution")
_plm = LazyModule("dp_accounting.pld.privacy_loss_mechanism")

VALUE_DISCRETIZATION = 1e-4  # dp_accounting's default for PLDAccountant
# Searches (calibration, the largest count that fits) run on a 10× coarser grid, about ten
# times faster; every answer is then checked, and corrected, on the fine grid above.
SEARCH_DISCRETIZATION = 1e-3
# The most grid points one release's privacy loss may take (at 1e-4: σ ≈ 0.12 with q = 0.01, where
# building it took about 4 s and 0.3 GB, 2026-12-07); a wider span gets a coarser grid (see above).
MAX_GRID_POINTS = 2**20
# The coarsest grid composed (nats): one release spanning more than 2²⁰ nats is refused.
MAX_GRID = 1.0


_GAUSSIAN_KINDS = (Gaussian, PoissonGaussian)
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
    built = [(e, g, base_pld(e, g)) for e in events for g in [grid([(e, 1)], vdi)]]
    return [item for item in built if item[2] is not None]


def import_base_plds(items) -> None:
    """Use the PLDs of :func:`export_base_plds` for those events and grids from now on (where
    this process has not built its own yet). They are what this process would have built: the
    construction is deterministic, and pickling keeps every float."""
    for event, vdi, pld in items:
        _HANDED[(event, float(vdi))] = pld


@functools.lru_cache(maxsize=256)
def loss_span(event: PrivacyEvent, count: int = 1) -> float:
    """The span (nats) of the privacy loss that dp_accounting discretises for ``count`` releases
    of ``event`` as :func:`_part` builds them (one release, self-composed; a Gaussian on the
    whole dataset at σ/√count): its connect-the-dots bounds, the wider of the two adjacencies;
    ``inf`` where they overflow a float (σ or b that small). 0 for an event kind without a
    closed-form privacy loss here."""
    if isinstance(event, _GAUSSIAN_KINDS):
        sigma = event.noise_multiplier / (math.sqrt(count) if isinstance(event, Gaussian) else 1.0)

        def loss(adjacency):
            return _plm.GaussianPrivacyLoss(
                sigma, sensitivity=1.0, sampling_prob=event.sample_rate, adjacency_type=adjacency
            )

    elif isinstance(event, (Laplace, PoissonLaplace)):

        def loss(adjacency):
            return _plm.LaplacePrivacyLoss(
                event.noise_multiplier, sensitivity=1.0, sampling_prob=event.sample_rate, adjacency_type=adjacency
            )

    else:
        return 0.0
    spans = []
    for adjacency in (_plm.AdjacencyType.ADD, _plm.AdjacencyType.REMOVE):
        try:
            bounds = loss(adjacency).connect_dots_bounds()
        except OverflowError:
            return math.inf
        spans.append(float(bounds.epsilon_upper) - float(bounds.epsilon_lower))
    return max(spans)


def grid(groups, vdi: float) -> float:
    """The grid ``groups`` are composed on: ``vdi``, or coarser where a part's privacy loss spans
    more than ``MAX_GRID_POINTS`` of it (module doc); one grid for the whole history. Raises
    DPConfigError past ``MAX_GRID``."""
    spans = [(loss_span(e, int(c)), e, int(c)) for e, c in groups]
    span, worst, count = max(spans, key=lambda sec: sec[0], default=(0.0, None, 0))
    g = max(float(vdi), span / MAX_GRID_POINTS)
    if g > MAX_GRID:
        releases = f"{count} releases" if not worst.sampled and count > 1 else "one release"
        alternative = ", or accountant='rdp', which composes any σ" if isinstance(worst, _GAUSSIAN_KINDS) else ""
        raise DPConfigError(
            f"σ={worst.noise_multiplier:g} ({worst.kind}, q={worst.sample_rate:g}) is too small for the pld "
            f"accountant: {releases}' privacy loss spans {span:.3g} nats, more than a {MAX_GRID:g}-nat grid "
            f"of {MAX_GRID_POINTS:,} points holds (ε is then in the hundreds of thousands or more). "
            f"Use a larger noise multiplier{alternative}."
        )
    return g


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
    """The PLD of every release in ``groups`` (positive counts), composed on :func:`grid`."""
    vdi = grid(groups, vdi)
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

    def check(self, event: PrivacyEvent, count: int = 1) -> None:
        """Raise DPConfigError if ``count`` releases of ``event`` cannot be composed (:func:`grid`;
        the count matters for a release on the whole dataset only)."""
        grid([(event, count)], self.vdi)
