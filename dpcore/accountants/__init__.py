"""Accountants: a run's privacy events → ε at δ (or δ at ε). One small protocol, one registry.

A run's history is a list of ``(event, count)`` pairs (:mod:`dpcore.events`). Every accountant
here is for the add/remove-one relation and gives an upper bound on the true ε:

* ``"pld"`` (default, :mod:`.pld`): privacy-loss distributions, as
  ``dp_accounting.pld.PLDAccountant`` (pessimistic discretisation). Tight.
* ``"rdp"`` (:mod:`.rdp`): Rényi DP, ``dp_accounting.rdp.RdpAccountant`` with the modern
  conversion (Balle et al. 2020): the moments accountant in today's terms, about 8–25 % looser
  (9–25 % measured against PLD on six settings, 2026-11-29; 8.6–21 % on nine, 2026-12-07).
* ``"moments"`` (:mod:`.moments`): Abadi et al.'s original moments accountant, computed here
  independently of dp_accounting (integer orders, the paper's tail bound). Gaussian only.

σ calibration and the largest step count that fits a budget are in :mod:`.calibration`.

To add an accountant: one module with a class that meets :class:`Accountant`, one
:func:`register` call at the end of this file, and one test against an independent reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ..errors import DPConfigError
from ..events import PrivacyEvent, positive_groups
from ..validation import check_epsilon

Groups = Sequence[tuple[PrivacyEvent, int]]


class Accountant(Protocol):
    """Composes a run's events into (ε, δ). Stateless: the ledger holds the history. One may
    also have ``check(event, count)``, raising DPConfigError for releases it cannot compose
    (:func:`check_composable`; the ledger calls it before anything is drawn)."""

    name: str

    def epsilon(self, groups: Groups, delta: float, *, coarse: bool = False) -> float:
        """ε at ``delta`` after ``count`` releases of each event. ``coarse=True`` may trade a
        little accuracy for speed inside searches; every search answer is then re-checked
        with ``coarse=False``."""
        ...

    def delta(self, groups: Groups, epsilon: float) -> float:
        """δ at a fixed ``epsilon`` after ``count`` releases of each event."""
        ...


ACCOUNTANTS: dict[str, Accountant] = {}


def register(accountant: Accountant) -> Accountant:
    ACCOUNTANTS[accountant.name] = accountant
    return accountant


def check_accountant(accountant: str) -> str:
    if accountant not in ACCOUNTANTS:
        raise DPConfigError(
            f"accountant={accountant!r} is unknown; choose one of {tuple(ACCOUNTANTS)} (pld is the tight default)."
        )
    return accountant


def get(accountant: str) -> Accountant:
    return ACCOUNTANTS[check_accountant(accountant)]


def epsilon(
    groups: Groups,
    delta: float,
    accountant: str = "pld",
    value_discretization_interval: float | None = None,
    *,
    coarse: bool = False,
) -> float:
    """ε at ``delta`` after composing ``count`` repetitions of each event, in their canonical form
    (:func:`dpcore.events.positive_groups`): the ledger, the budget check and the calibration all
    compose through here. ``value_discretization_interval`` sets the PLD grid (default:
    dp_accounting's 1e-4); ``coarse``, the searches' coarser grid."""
    acc = get(accountant)
    groups = positive_groups(groups)
    if not groups:
        return 0.0
    if value_discretization_interval is not None and accountant == "pld":
        acc = pld.PLD(value_discretization_interval)
    return float(acc.epsilon(groups, delta, coarse=coarse))


def check_composable(event: PrivacyEvent, accountant: str = "pld", count: int = 1) -> None:
    """Raise DPConfigError if ``accountant`` cannot compose ``count`` releases of ``event`` (an
    accountant's optional ``check``: the PLD's for a σ too small for its grid)."""
    check = getattr(get(accountant), "check", None)
    if check is not None:
        check(event, count)


def delta(groups: Groups, epsilon: float, accountant: str = "pld") -> float:
    """δ at a fixed ``epsilon``: the quantity of Geyer et al.'s stopping rule."""
    acc = get(accountant)
    epsilon = check_epsilon(epsilon, "epsilon")
    groups = positive_groups(groups)
    return 0.0 if not groups else float(acc.delta(groups, epsilon))


from . import moments, pld, rdp  # noqa: E402  (the built-in accountants register below)

register(pld.PLD())
register(rdp.RDP())
register(moments.Moments())
