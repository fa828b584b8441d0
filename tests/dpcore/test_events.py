"""dpcore/events.py: privacy events are typed values (the type is part of the value), the old untyped
form and a journal's stored kind rebuild the same event, and malformed events are refused."""

import pytest

import dpcore
from dpcore.accounting import PrivacyEvent


def test_events_are_typed_values_and_the_old_untyped_form_builds_them():
    from dpcore import events

    ev = PrivacyEvent("poisson_gaussian", 1.5, 0.05)
    assert type(ev) is events.PoissonGaussian and ev == PrivacyEvent.dpsgd_step(1.5, 0.05)
    # the type is part of the value
    assert PrivacyEvent.of("laplace", 2.0) == events.Laplace(2.0) != events.Gaussian(2.0)
    assert len({events.Gaussian(2.0), events.Gaussian(2.0), events.Laplace(2.0)}) == 2
    for kind, cls in events.EVENTS.items():  # what a journal stores (the kind) rebuilds the same event
        ev = cls(3.0, 1.0 if not cls.sampled else 0.1)
        assert PrivacyEvent.of(ev.kind, ev.noise_multiplier, ev.sample_rate) == ev and ev.kind == kind
    with pytest.raises(dpcore.DPConfigError, match="whole dataset"):
        events.Gaussian(2.0, 0.5)
    with pytest.raises(dpcore.DPConfigError, match="unknown"):
        PrivacyEvent.of("exponential", 1.0)
