"""Resuming a run and recovering its ledger's journal: a seeded run resumes bit for bit from its state
dicts; releases made after the last checkpoint survive a crash in the journal, are marked rolled back
on resume and counted in ε; a journal of another budget is refused; a torn or unterminated last line
is repaired while a whole last line that does not parse is refused, not dropped; and a read-only
ledger leaves a line being written alone and records nothing."""

import io

import pytest
import torch

import dpcore

from ..helpers import ce, tiny_mlp


def test_seeded_run_resumes_reproducibly_from_state_dicts():
    def build():
        torch.manual_seed(0)
        model = tiny_mlp()
        return (
            model,
            dpcore.make_private(
                model,
                torch.optim.Adam(model.parameters(), lr=0.05),
                ce,
                dataset_size=60,
                lot_size=10,
                epochs=2,
                target_epsilon=8.0,
                target_delta=1e-5,
                clip_norm=1.0,
                seed=5,
                epsilon_every=10**6,
                clipping="vmap",  # (with "auto", the resumed run verifies book-keeping on another lot, summed by vmap: last bits differ)
            ),
        )

    x, y = torch.randn(60, 6), torch.randint(0, 3, (60,))
    model_a, a = build()
    for _ in range(4):
        lot = a.sampler.sample()
        a.optimizer.accumulate(x[lot], y[lot])
        a.optimizer.step()
    buf = io.BytesIO()  # serialised as a real checkpoint is (state_dicts hold live tensors)
    torch.save(
        {
            "model": model_a.state_dict(),
            "opt": a.optimizer.state_dict(),
            "sampler": a.sampler.state_dict(),
            "ledger": a.ledger.state_dict(),
        },
        buf,
    )
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    for _ in range(3):
        lot = a.sampler.sample()
        a.optimizer.accumulate(x[lot], y[lot])
        a.optimizer.step()
    model_b, b = build()
    model_b.load_state_dict(ckpt["model"])
    b.optimizer.load_state_dict(ckpt["opt"])
    b.sampler.load_state_dict(ckpt["sampler"])
    b.ledger.load_state_dict(ckpt["ledger"])
    for _ in range(3):
        lot = b.sampler.sample()
        b.optimizer.accumulate(x[lot], y[lot])
        b.optimizer.step()
    for pa_, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa_, pb)
    assert len(b.ledger) == len(a.ledger) == 7


def test_crash_after_checkpoint_keeps_every_release_in_the_journal(tmp_path):
    """Releases made after the last checkpoint survive a crash through the ledger's journal,
    are marked rolled back on resume, and are counted in ε."""
    journal = tmp_path / "ledger.jsonl"
    x, y = torch.randn(60, 6), torch.randint(0, 3, (60,))

    def build():
        torch.manual_seed(0)
        model = tiny_mlp()
        return model, dpcore.make_private(
            model,
            torch.optim.Adam(model.parameters(), lr=0.05),
            ce,
            dataset_size=60,
            lot_size=10,
            epochs=2,
            target_epsilon=8.0,
            target_delta=1e-5,
            clip_norm=1.0,
            epsilon_every=10**6,
            journal=str(journal),
        )

    def steps(p, k):
        for _ in range(k):
            lot = p.sampler.sample()
            p.optimizer.accumulate(x[lot], y[lot])
            p.optimizer.step()

    model_a, a = build()
    steps(a, 4)
    buf = io.BytesIO()
    torch.save(
        {
            "model": model_a.state_dict(),
            "opt": a.optimizer.state_dict(),
            "sampler": a.sampler.state_dict(),
            "ledger": a.ledger.state_dict(),
        },
        buf,
    )
    steps(a, 3)  # released, then the process "crashes" before the next checkpoint
    del model_a, a
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)

    model_b, b = build()  # secure mode: the re-run draws fresh noise
    assert len(b.ledger) == 7  # every release, from the journal
    with pytest.raises(dpcore.DPConfigError, match="would forget releases"):
        b.ledger.load_state_dict(ckpt["ledger"])
    model_b.load_state_dict(ckpt["model"])
    b.optimizer.load_state_dict(ckpt["opt"])
    b.sampler.load_state_dict(ckpt["sampler"])
    assert b.ledger.mark_rolled_back(after_step=ckpt["opt"]["steps_taken"]) == 3
    steps(b, 3)
    assert len(b.ledger) == 10
    assert sorted(b.ledger.committed_steps()) == list(range(1, 8))
    assert sum(e.status == "rolled_back" for e in b.ledger.entries) == 3
    ev = b.optimizer.event
    assert b.ledger.epsilon() == pytest.approx(dpcore.epsilon([(ev, 10)], 1e-5), rel=1e-12)
    # A third process sees the same history, rollback marks included.
    _, c = build()
    assert [(e.step, e.status) for e in c.ledger.entries] == [(e.step, e.status) for e in b.ledger.entries]


def test_journal_of_another_budget_is_refused(tmp_path):
    j = tmp_path / "l.jsonl"
    dpcore.PrivacyLedger(2.0, 1e-5, journal=j).append(dpcore.PrivacyEvent.dpsgd_step(1.0, 0.1), step=1, clip_norm=1.0)
    with pytest.raises(dpcore.DPConfigError, match="different budget"):
        dpcore.PrivacyLedger(3.0, 1e-5, journal=j)


def _two_release_journal(tmp_path):
    """A journal of two releases: (its path, the step event, its bytes)."""
    path = tmp_path / "ledger.journal.jsonl"
    ev = dpcore.PrivacyEvent.dpsgd_step(1.0, 0.01)
    ledger = dpcore.PrivacyLedger(5.0, 1e-5, journal=path)
    ledger.append(ev, step=1, clip_norm=1.0)
    ledger.append(ev, step=2, clip_norm=1.0)
    return path, ev, path.read_bytes()


@pytest.mark.parametrize("tail", [b'{"op": "append", "index": 2, "st', b""])
def test_a_torn_or_unterminated_last_journal_line_is_repaired_and_the_journal_stays_usable(tmp_path, tail):
    path, ev, raw = _two_release_journal(tmp_path)
    # A crash mid-write: either half a record, or a whole record without its newline.
    path.write_bytes(raw + tail if tail else raw[:-1])
    reopened = dpcore.PrivacyLedger(5.0, 1e-5, journal=path)
    assert len(reopened) == 2
    reopened.mark_rolled_back(1)
    reopened.append(ev, step=2, clip_norm=1.0)
    again = dpcore.PrivacyLedger(5.0, 1e-5, journal=path)  # the next record did not merge into the torn line
    assert [(e.step, e.status) for e in again.entries] == [(1, "committed"), (2, "rolled_back"), (2, "committed")]
    assert path.read_bytes().endswith(b"\n")


def test_a_whole_last_journal_line_that_does_not_parse_is_refused_not_dropped(tmp_path):
    """helper-29: a torn write lacks its newline (each record is written with it); a last line
    that has its newline but does not parse is damage, and dropping it could drop a release."""
    path, _, raw = _two_release_journal(tmp_path)
    damaged = raw[:-10] + b"\x00" * 9 + b"\n"  # the last record's end zeroed, its newline kept
    path.write_bytes(damaged)
    with pytest.raises(dpcore.DPConfigError, match="is corrupt at line 3"):
        dpcore.PrivacyLedger(5.0, 1e-5, journal=path)
    assert path.read_bytes() == damaged  # nothing cut


def test_a_read_only_ledger_leaves_a_line_being_written_and_records_nothing(tmp_path):
    """The driver reads the journal that rank 0 may still be writing: it must not cut a last
    line that is not yet complete (rank 0's write would then end in a corrupt line), and it
    records nothing. The writer's next read repairs as before."""
    path = tmp_path / "ledger.journal.jsonl"
    ev = dpcore.PrivacyEvent.dpsgd_step(1.0, 0.01)
    writer = dpcore.PrivacyLedger(5.0, 1e-5, journal=path)
    writer.append(ev, step=1, clip_norm=1.0)
    partial = path.read_bytes() + b'{"op": "append", "index": 1, "st'
    path.write_bytes(partial)  # the next record, half written
    reader = dpcore.PrivacyLedger(5.0, 1e-5, journal=path, read_only=True)
    assert len(reader) == 1 and path.read_bytes() == partial
    with pytest.raises(dpcore.DPConfigError, match="records nothing"):
        reader.append(ev, step=2, clip_norm=1.0)
    with pytest.raises(dpcore.DPConfigError, match="records nothing"):
        reader.mark_rolled_back(0)
    assert path.read_bytes() == partial and len(reader) == 1 and reader.entries[0].status == "committed"
    with pytest.raises(dpcore.DPConfigError, match="needs an existing journal"):
        dpcore.PrivacyLedger(5.0, 1e-5, journal=tmp_path / "none.jsonl", read_only=True)
    assert len(dpcore.PrivacyLedger(5.0, 1e-5, journal=path)) == 1 and path.read_bytes().endswith(b"\n")
