"""The ledger's state_dict (dpcore/ledger/ledger.py, dpcore/ledger/journal.py): a ledger survives a
round trip through a checkpoint keeping its budget, δ and accountant; a state loaded into a
journalled ledger is written to its journal first (another history, a changed status or an
unreadable state is refused); and a journal write that fails part-way leaves the ledger as it was."""

import io
import math

import pytest
import torch

import dpcore
from dpcore.accounting import PrivacyEvent


def _cols_equal(a, b):
    for k in a:
        for x, y in zip(a[k], b[k]):
            if not (x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))):
                return False
    return True


def _ledger_of(ev, releases: int, journal=None) -> dpcore.PrivacyLedger:
    """A ledger at ε = 4, δ = 1e-5 holding ``releases`` of ``ev`` (steps 1, 2, …)."""
    ledger = dpcore.PrivacyLedger(4.0, 1e-5, journal=journal)
    for s in range(1, releases + 1):
        ledger.append(ev, step=s, clip_norm=1.0)
    return ledger


def test_ledger_survives_a_state_dict_round_trip_through_a_checkpoint():
    ledger = dpcore.PrivacyLedger(4.0, 1e-5, epsilon_every=7)
    ev = PrivacyEvent.dpsgd_step(1.0, 0.03)
    for s in range(1, 40):
        ledger.append(ev, step=s, clip_norm=1.0)
    ledger.mark_rolled_back(after_step=30)
    buf = io.BytesIO()
    torch.save({"ledger": ledger.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)["ledger"]
    restored = dpcore.PrivacyLedger(4.0, 1e-5)
    restored.load_state_dict(state)
    assert _cols_equal(restored.to_columns(), ledger.to_columns())
    assert restored.epsilon() == ledger.epsilon()
    assert restored.allowance(ev) == ledger.allowance(ev)
    # A resumed ledger must keep its budget, δ and accountant.
    with pytest.raises(dpcore.DPConfigError, match="budget"):
        dpcore.PrivacyLedger(8.0, 1e-5).load_state_dict(state)
    with pytest.raises(dpcore.DPConfigError, match="δ"):
        dpcore.PrivacyLedger(4.0, 1e-6).load_state_dict(state)


def test_a_state_loaded_into_a_journalled_ledger_is_written_to_its_journal(tmp_path):
    """A state whose releases the journal lacks (a checkpoint of a ledger kept without one) is
    written to the journal before it is taken: a restart, which reads only the journal, counts
    every release and allows no more steps than the budget. A state from another history (its
    releases do not begin with the journal's) is refused."""
    ev = dpcore.PrivacyEvent.dpsgd_step(1.0, 0.05)
    plain = _ledger_of(ev, 30)
    journal = tmp_path / "ledger.journal.jsonl"
    ledger = dpcore.PrivacyLedger(4.0, 1e-5, journal=journal)
    ledger.load_state_dict(plain.state_dict())
    for s in range(31, 36):
        ledger.append(ev, step=s, clip_norm=1.0)
    reopened = dpcore.PrivacyLedger(4.0, 1e-5, journal=journal)
    assert len(reopened) == len(ledger) == 35
    assert reopened.epsilon() == ledger.epsilon() == pytest.approx(dpcore.epsilon([(ev, 35)], 1e-5), rel=1e-12)
    assert reopened.allowance(ev) == ledger.allowance(ev)
    # Loading the same history again, or a later state of it, is fine; another history is not.
    reopened.load_state_dict(ledger.state_dict())
    other = dpcore.PrivacyLedger(4.0, 1e-5)
    for s in range(1, 41):
        other.append(dpcore.PrivacyEvent.dpsgd_step(2.0, 0.05), step=s, clip_norm=1.0)
    with pytest.raises(dpcore.DPConfigError, match="another history"):
        reopened.load_state_dict(other.state_dict())
    assert len(dpcore.PrivacyLedger(4.0, 1e-5, journal=journal)) == 35
    # A checkpoint taken before the journal's rollback: the releases' status differs.
    checkpoint = reopened.state_dict()
    reopened.mark_rolled_back(after_step=30)
    with pytest.raises(dpcore.DPConfigError, match="status .* differs.*mark_rolled_back"):
        dpcore.PrivacyLedger(4.0, 1e-5, journal=journal).load_state_dict(checkpoint)
    # A state this version cannot read is refused before anything is written or taken.
    bad = reopened.state_dict()
    bad["entries"].append({**bad["entries"][-1], "index": 35, "step": 36, "unknown_field": 1})
    with pytest.raises(dpcore.DPConfigError, match="cannot read"):
        reopened.load_state_dict(bad)
    bad["entries"][-1] = {**bad["entries"][-2], "index": 7}
    with pytest.raises(dpcore.DPConfigError, match="malformed"):
        reopened.load_state_dict(bad)
    after = dpcore.PrivacyLedger(4.0, 1e-5, journal=journal)
    assert len(after) == len(reopened) == 35 and after.epsilon() == reopened.epsilon()


def test_a_journal_write_that_fails_while_a_state_loads_leaves_the_ledger_as_it_was(tmp_path, monkeypatch):
    """The state's releases go to the journal before the ledger takes them: when a write fails
    part-way (a full disk), the ledger still holds only what it held, and the journal holds
    those and the releases written before the failure, so a restart counts at least as many
    releases as any ledger in memory ever did."""
    from dpcore.ledger.journal import Journal

    ev = dpcore.PrivacyEvent.dpsgd_step(1.0, 0.05)
    plain = _ledger_of(ev, 20)
    journal = tmp_path / "ledger.journal.jsonl"
    ledger = _ledger_of(ev, 5, journal=journal)
    before = (len(ledger), ledger.epsilon(), ledger.allowance(ev))
    write, written = Journal.write, []

    def fails_on_the_fourth(self, record):
        if len(written) == 3:
            raise OSError(28, "No space left on device")
        write(self, record)
        written.append(record)

    monkeypatch.setattr(Journal, "write", fails_on_the_fourth)
    with pytest.raises(OSError, match="No space"):
        ledger.load_state_dict(plain.state_dict())
    monkeypatch.setattr(Journal, "write", write)
    assert (len(ledger), ledger.epsilon(), ledger.allowance(ev)) == before
    assert [r["step"] for r in written] == [6, 7, 8]
    reopened = dpcore.PrivacyLedger(4.0, 1e-5, journal=journal)
    assert len(reopened) == 8 and reopened.epsilon() == pytest.approx(dpcore.epsilon([(ev, 8)], 1e-5), rel=1e-12)
    reopened.load_state_dict(plain.state_dict())  # with the disk back, the rest is written and taken
    assert len(reopened) == len(dpcore.PrivacyLedger(4.0, 1e-5, journal=journal)) == 20
