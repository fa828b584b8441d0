"""The old import path of events, accountants and calibration (kept as an alias).

New code imports :mod:`dpcore.events` (typed privacy events), :mod:`dpcore.accountants`
(the accountants behind one protocol and a registry) and
:mod:`dpcore.accountants.calibration` (σ for a target, the largest step count that fits).
"""

from .accountants import ACCOUNTANTS, Accountant, check_accountant, delta, epsilon, register
from .accountants.calibration import (
    _largest_count,
    _largest_count_near,
    calibrate_noise_multiplier,
    dpsgd_epsilon,
    max_steps,
    max_steps_by_delta,
    steps_for_epochs,
)
from .accountants.moments import ORDERS as MOMENTS_ORDERS
from .accountants.moments import moments_epsilon
from .accountants.pld import SEARCH_DISCRETIZATION as PLD_SEARCH_DISCRETIZATION
from .accountants.pld import VALUE_DISCRETIZATION as PLD_VALUE_DISCRETIZATION
from .accountants.pld import base_pld as _base_pld
from .accountants.rdp import quiet_absl as _quiet_absl
from .events import EVENT_KINDS, GAUSSIAN, LAPLACE, POISSON_GAUSSIAN, POISSON_LAPLACE, PrivacyEvent, compose

__all__ = [
    "ACCOUNTANTS", "Accountant", "EVENT_KINDS", "GAUSSIAN", "LAPLACE", "MOMENTS_ORDERS", "PLD_SEARCH_DISCRETIZATION",
    "PLD_VALUE_DISCRETIZATION", "POISSON_GAUSSIAN", "POISSON_LAPLACE", "PrivacyEvent", "_base_pld", "_largest_count",
    "_largest_count_near", "_quiet_absl", "calibrate_noise_multiplier", "check_accountant", "compose", "delta",
    "dpsgd_epsilon", "epsilon", "max_steps", "max_steps_by_delta", "moments_epsilon", "register", "steps_for_epochs",
]  # fmt: skip
