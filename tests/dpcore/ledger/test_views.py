"""The ledger's readable views (dpcore/ledger/views.py): runs() has one row per run of identical
releases, rolled-back ones apart, each with the cumulative ε after it as dp_accounting gives it; and
to_columns() loads into Arrow with the expected types."""

import dp_accounting
import pytest

import dpcore
from dpcore.accounting import PrivacyEvent

from .._common import _dpa_pld


def test_the_readable_ledger_has_one_row_per_run_of_identical_releases():
    """ledger.runs() (the MLflow UI's table): runs of consecutive identical releases, rolled-back
    ones apart, each with the cumulative ε after it, checked against dp_accounting."""
    a, b = PrivacyEvent.dpsgd_step(2.0, 0.02), PrivacyEvent.dpsgd_step(4.0, 0.05)
    ledger = dpcore.PrivacyLedger(None, 1e-5)
    for step in range(1, 11):
        ledger.append(a, step=step, clip_norm=1.0)
    ledger.mark_rolled_back(after_step=7)  # a restart from the step-7 checkpoint
    for step in range(8, 12):
        ledger.append(a, step=step, clip_norm=1.0)
    for step in range(12, 14):
        ledger.append(b, step=step, clip_norm=0.5)
    rows = ledger.runs()
    assert [(r["kind"], r["status"], r["count"], r["first_step"], r["last_step"], r["clip_norm"]) for r in rows] == [
        ("poisson_gaussian", "committed", 7, 1, 7, 1.0),
        ("poisson_gaussian", "rolled_back", 3, 8, 10, 1.0),
        ("poisson_gaussian", "committed", 4, 8, 11, 1.0),
        ("poisson_gaussian", "committed", 2, 12, 13, 0.5),
    ]
    assert sum(r["count"] for r in rows) == len(ledger) == 16
    prefix = [(7, 0), (10, 0), (14, 0), (14, 2)]  # releases of a and b up to the end of each row
    for r, (na, nb) in zip(rows, prefix):
        events = [dp_accounting.SelfComposedDpEvent(a.to_dp_event(), na)]
        if nb:
            events.append(dp_accounting.SelfComposedDpEvent(b.to_dp_event(), nb))
        assert r["epsilon_after"] == pytest.approx(_dpa_pld(dp_accounting.ComposedDpEvent(events), 1e-5), rel=1e-9)
    assert rows[-1]["epsilon_after"] == ledger.epsilon()


def test_ledger_columns_load_into_arrow():
    pa = pytest.importorskip("pyarrow")
    ledger = dpcore.PrivacyLedger(None, 1e-5, epsilon_every=2)
    for s in range(1, 6):
        ledger.append(PrivacyEvent.dpsgd_step(1.0, 0.1), step=s, clip_norm=1.0)
    table = pa.table(ledger.to_columns())
    assert table.num_rows == 5
    assert table.column("step").to_pylist() == [1, 2, 3, 4, 5]
    assert table.schema.field("epsilon").type == pa.float64()
    assert table.schema.field("kind").type == pa.string()
