"""Privacy events: what a run released, as typed, frozen data (after dp_accounting's ``DpEvent``).

Every noisy release of a run is one event. Events are values: equal events compare and hash
equal, so a ledger counts them, and a list of ``(event, count)`` pairs is a whole run's
privacy history, which any accountant (:mod:`dpcore.accountants`) turns into ε at a δ
without touching data.

All events are for the add/remove-one neighbouring relation at the example level (or the
client level, for DP-FedAvg: then one "example" is one client's update).

To add a kind of release: one subclass here with its :meth:`mechanism`, declared with
``@event(kind)`` (``@event(kind, sampled=False)`` for a release on the whole dataset), which
makes it a frozen dataclass and registers it; accountants that need more than the dp_accounting
event (the PLD cache, the moments accountant) say so for the kinds they know.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from ._lazy import LazyModule
from .errors import DPConfigError
from .validation import check_noise_multiplier, check_sample_rate

dp_accounting = LazyModule("dp_accounting")  # imported on first use (dpcore._lazy)

POISSON_GAUSSIAN = "poisson_gaussian"
GAUSSIAN = "gaussian"
POISSON_LAPLACE = "poisson_laplace"
LAPLACE = "laplace"

EVENTS: dict[str, type[PrivacyEvent]] = {}


def register_event(cls: type[PrivacyEvent]) -> type[PrivacyEvent]:
    """Class decorator: make ``cls`` known by its ``kind`` (journals and ledgers store the kind)."""
    if not cls.kind or cls.kind in EVENTS:
        raise ValueError(f"event kind {cls.kind!r} is empty or already registered")
    EVENTS[cls.kind] = cls
    return cls


def event(kind: str, sampled: bool = True):
    """Class decorator for a kind of release: sets its ``kind`` (and ``sampled``), makes it a
    frozen dataclass (values: equal events hash equal) and registers it."""

    def declare(cls):
        cls.kind, cls.sampled = kind, sampled
        return register_event(dataclass(frozen=True)(cls))

    return declare


class _ByKind(type):
    """``PrivacyEvent(kind, σ, q)`` (the untyped form of earlier versions) builds the typed event."""

    def __call__(cls, *args, **kwargs):
        if cls is PrivacyEvent:
            return PrivacyEvent.of(*args, **kwargs)
        return super().__call__(*args, **kwargs)


@dataclass(frozen=True)
class PrivacyEvent(metaclass=_ByKind):
    """One noisy release.

    ``noise_multiplier`` is noise scale / sensitivity: σ for Gaussian events (std σ·C) and
    b/Δ₁ for Laplace events. ``sample_rate`` is the Poisson rate q of the examples the release
    was computed from (1.0 for a release on the whole dataset).

    The base class is not instantiated itself: ``PrivacyEvent(kind, σ, q)`` and
    :meth:`of` build the subclass registered for ``kind``.
    """

    noise_multiplier: float
    sample_rate: float = 1.0

    kind: ClassVar[str] = ""
    sampled: ClassVar[bool] = True  # False: a release on the whole dataset (q is 1)

    def __post_init__(self):
        check_noise_multiplier(self.noise_multiplier)
        check_sample_rate(self.sample_rate)
        if not self.sampled and self.sample_rate != 1.0:
            raise DPConfigError(f"a {self.kind!r} event is a release on the whole dataset: sample_rate must be 1.0.")

    def mechanism(self) -> dp_accounting.DpEvent:
        """The noise added to one release on the whole dataset, as a dp_accounting event."""
        raise NotImplementedError

    def to_dp_event(self) -> dp_accounting.DpEvent:
        """The release as dp_accounting composes it: the mechanism, Poisson-subsampled at rate q
        unless the release is on the whole dataset."""
        inner = self.mechanism()
        return dp_accounting.PoissonSampledDpEvent(self.sample_rate, inner) if self.sampled else inner

    def with_noise(self, noise_multiplier: float) -> PrivacyEvent:
        """The same release with another noise multiplier (calibration searches over these)."""
        return replace(self, noise_multiplier=float(noise_multiplier))

    @staticmethod
    def of(kind: str, noise_multiplier: float, sample_rate: float = 1.0) -> PrivacyEvent:
        """The event of kind ``kind`` (its registered name, as journals store it)."""
        if kind not in EVENTS:
            raise DPConfigError(f"event kind {kind!r} is unknown; use one of {tuple(EVENTS)}.")
        return EVENTS[kind](float(noise_multiplier), float(sample_rate))

    @staticmethod
    def dpsgd_step(noise_multiplier: float, sample_rate: float) -> PoissonGaussian:
        """One DP-SGD step: a Poisson-sampled lot, Gaussian noise."""
        return PoissonGaussian(float(noise_multiplier), float(sample_rate))


class _GaussianNoise:
    def mechanism(self) -> dp_accounting.DpEvent:
        return dp_accounting.GaussianDpEvent(self.noise_multiplier)


class _LaplaceNoise:
    def mechanism(self) -> dp_accounting.DpEvent:
        return dp_accounting.LaplaceDpEvent(self.noise_multiplier)


@event(POISSON_GAUSSIAN)
class PoissonGaussian(_GaussianNoise, PrivacyEvent):
    """One DP-SGD step (or DP-FedAvg round): clipped sum of a Poisson lot + N(0, σ²C²)."""


@event(POISSON_LAPLACE)
class PoissonLaplace(_LaplaceNoise, PrivacyEvent):
    """Laplace noise of scale b = σ·Δ₁ on the L1-clipped sum of a Poisson lot (DP-Adam's form)."""


@event(GAUSSIAN, sampled=False)
class Gaussian(_GaussianNoise, PrivacyEvent):
    """A Gaussian release on the whole dataset (DP-PCA's noised Gram matrix)."""


@event(LAPLACE, sampled=False)
class Laplace(_LaplaceNoise, PrivacyEvent):
    """A Laplace release on the whole dataset."""


EVENT_KINDS = tuple(EVENTS)


def positive_groups(groups) -> list[tuple[PrivacyEvent, int]]:
    """``groups`` in one canonical form: counts as ints, those ≤ 0 dropped, equal events merged,
    in the order of their ``repr``. Composition is commutative but its floating point is not
    (PLD: 5e-12 between orders): in this form the budget check, which composes the step event
    after the others, and the ledger, which lists events as first seen, compute the same ε to
    the bit."""
    merged: dict[PrivacyEvent, int] = {}
    for e, c in groups:
        if int(c) > 0:
            merged[e] = merged.get(e, 0) + int(c)
    return sorted(merged.items(), key=lambda kv: repr(kv[0]))


def compose(groups) -> dp_accounting.DpEvent:
    """The dp_accounting event for ``count`` repetitions of each event, all composed."""
    parts = [dp_accounting.SelfComposedDpEvent(e.to_dp_event(), c) for e, c in positive_groups(groups)]
    if not parts:
        return dp_accounting.NoOpDpEvent()
    return parts[0] if len(parts) == 1 else dp_accounting.ComposedDpEvent(parts)
