"""dpcore/accountants/__init__.py: an accountant added to the registry with one register() call is
used by name by the ledger's budget, max_steps and calibration; and every registered accountant's ε
does not depend on the order or grouping of the releases (one canonical form, to the bit)."""

import pytest

import dpcore
from dpcore.accounting import PrivacyEvent


def test_an_accountant_added_to_the_registry_is_used_by_calibration_and_the_ledger_budget():
    """One class meeting the protocol plus one register() call: the ledger, calibration and
    max_steps use it by name. This one doubles RDP's ε, so everything must come out exactly as
    RDP at half the target."""
    from dpcore import accountants
    from dpcore.accountants.rdp import RDP

    class DoubleRDP(RDP):
        name = "double_rdp"

        def epsilon(self, groups, delta, *, coarse=False):
            return 2.0 * super().epsilon(groups, delta, coarse=coarse)

    accountants.register(DoubleRDP())
    try:
        ev = PrivacyEvent.dpsgd_step(1.2, 0.02)
        fit = dpcore.max_steps(1.2, 0.02, 4.0, 1e-5, accountant="double_rdp")
        assert fit == dpcore.max_steps(1.2, 0.02, 2.0, 1e-5, accountant="rdp") > 0
        ledger = dpcore.PrivacyLedger(4.0, 1e-5, accountant="double_rdp")
        for step in range(1, fit + 1):
            ledger.append(ev, step=step, clip_norm=1.0)
        with pytest.raises(dpcore.BudgetExceededError):
            ledger.check(ev)
        assert ledger.epsilon() == pytest.approx(2.0 * dpcore.epsilon([(ev, fit)], 1e-5, "rdp"))
        sigma = dpcore.calibrate_noise_multiplier(4.0, 1e-5, 0.02, 500, accountant="double_rdp")
        assert sigma == pytest.approx(
            dpcore.calibrate_noise_multiplier(2.0, 1e-5, 0.02, 500, accountant="rdp"), rel=0.01
        )
    finally:
        del accountants.ACCOUNTANTS["double_rdp"]
    with pytest.raises(dpcore.DPConfigError, match="unknown"):
        dpcore.PrivacyLedger(1.0, 1e-5, accountant="double_rdp")


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_epsilon_does_not_depend_on_the_order_or_grouping_of_the_releases(accountant):
    """helper-29: PLD composition in another order gave ε 5e-12 apart, so the budget check (the
    step event last) and the ledger (events as first seen) could disagree at the boundary. Every
    accountant now composes one canonical form: equal events merged, in a fixed order."""
    import itertools

    from dpcore.accountants import epsilon

    a = dpcore.PrivacyEvent.dpsgd_step(1.1, 0.01)
    b = dpcore.PrivacyEvent.dpsgd_step(0.9, 0.02)
    c = dpcore.PrivacyEvent.of(dpcore.events.GAUSSIAN, 5.0)
    groups = [(a, 300), (b, 200), (c, 1)]
    values = {epsilon(list(p), 1e-5, accountant) for p in itertools.permutations(groups)}
    assert len(values) == 1  # to the bit
    split = [(a, 100), (b, 200), (c, 1), (a, 200), (b, 0)]  # a's releases in two groups, an empty one
    assert epsilon(split, 1e-5, accountant) == values.pop()
