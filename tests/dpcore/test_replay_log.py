"""Issue L: the replay log of released updates, and the optimizer's replay of them.

A restart that replays the logged releases must land bit for bit where the uninterrupted run
was, with every stream (sampler, noise, augmentation) where it was, and nothing released twice;
a torn, corrupt or foreign log gives its intact prefix or nothing, never a wrong update."""

import io

import pytest
import torch

import dpcore
from dpcore.ledger.replay import ReplayLogRefused, ReplayWriter, layout_of, read_segment, segment_path

from ..helpers import ce, tiny_mlp


def _params():
    torch.manual_seed(0)
    return dict(tiny_mlp().named_parameters())


def _write(folder, params, steps, run="run-a", after=0):
    w = ReplayWriter(folder, run, layout_of(params), after)
    sent = []
    for s in steps:
        update = [torch.randn_like(p) for p in params.values()]
        sent.append(torch.cat([u.reshape(-1) for u in update]))
        w.append(s, update)
    w.flush()
    return w, sent


def test_records_read_back_exactly_and_a_checkpoint_starts_a_new_segment(tmp_path):
    params = _params()
    w, sent = _write(tmp_path, params, [1, 2, 3])
    seg = read_segment(segment_path(tmp_path, 0), "run-a", 0, layout_of(params))
    assert seg.steps == (1, 2, 3) and seg.problem is None
    for i, flat in enumerate(sent):
        assert torch.equal(seg.payload(i), flat)
    w.rotate(3)  # the checkpoint of step 3 is complete: the older segment goes
    w.append(4, [torch.ones_like(p) for p in params.values()])
    w.flush()
    assert sorted(p.name for p in tmp_path.iterdir()) == [segment_path(tmp_path, 3).name]
    seg = read_segment(segment_path(tmp_path, 3), "run-a", 3, layout_of(params))
    assert seg.steps == (4,) and bool((seg.payload(0) == 1).all())
    w.close(remove=True)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("damage", ["torn", "flipped"])
def test_a_torn_or_corrupt_record_ends_the_intact_prefix(tmp_path, damage):
    params = _params()
    w, sent = _write(tmp_path, params, [1, 2, 3])
    w.close()
    path = segment_path(tmp_path, 0)
    seg = read_segment(path, "run-a", 0, layout_of(params))
    raw = bytearray(path.read_bytes())
    if damage == "torn":  # the crash came in the middle of the third record
        raw = raw[: seg.ends[1] + 20]
    else:  # one bit of the second record's payload
        raw[seg.spans[1][0] + 5] ^= 0x10
    path.write_bytes(bytes(raw))
    seg = read_segment(path, "run-a", 0, layout_of(params))
    kept = 2 if damage == "torn" else 1
    assert seg.steps == tuple(range(1, kept + 1))
    assert ("torn" in seg.problem) if damage == "torn" else ("checksum" in seg.problem)
    for i in range(kept):
        assert torch.equal(seg.payload(i), sent[i])


def test_a_log_of_another_run_or_another_model_is_refused(tmp_path):
    params = _params()
    _write(tmp_path, params, [1, 2])[0].close()
    path = segment_path(tmp_path, 0)
    with pytest.raises(ReplayLogRefused, match="belongs to run 'run-a'"):
        read_segment(path, "run-b", 0, layout_of(params))
    with pytest.raises(ReplayLogRefused, match="checkpoint of step 0"):
        read_segment(path, "run-a", 0, [["other.weight", [3, 3]]])
    path.write_bytes(b"not a log at all")
    with pytest.raises(ReplayLogRefused, match="not a replay log"):
        read_segment(path, "run-a", 0, layout_of(params))


class _Flip:
    """A seeded augmentation with a stream of its own: replay must move it on as the step did."""

    def __init__(self):
        self.generator = torch.Generator().manual_seed(3)

    def __call__(self, x):
        noise = torch.randn((x.shape[0], 2) + tuple(x.shape[1:]), generator=self.generator)
        return x.unsqueeze(1) + 0.1 * noise

    def state_dict(self):
        return {"g": self.generator.get_state()}

    def load_state_dict(self, s):
        self.generator.set_state(s["g"])


def _private(method="dpsgd"):
    torch.manual_seed(0)
    model = tiny_mlp()
    private = dpcore.make_private(
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
        method=method,
        ascent=0.05 if method == "dpsat" else 0.0,
        augment=_Flip(),
        augmentation_multiplicity=2,
        physical_batch_size=4,
    )
    return model, private


def _step(private, x, y):
    lot = private.sampler.sample()
    private.optimizer.accumulate(x[lot], y[lot])
    private.optimizer.step()
    return lot


def _state(model, private):
    buf = io.BytesIO()  # serialised, as a checkpoint is
    torch.save(
        {
            "model": model.state_dict(),
            "opt": private.optimizer.state_dict(),
            "sampler": private.sampler.state_dict(),
            "augment": private.optimizer.augment.state_dict(),
        },
        buf,
    )
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("method", ["dpsgd", "dpsat"])
def test_replaying_the_logged_releases_lands_bit_for_bit_on_the_uninterrupted_run(tmp_path, method):
    """Adam's moments, DP-SAT's previous release, the sampler's, the noise's and the
    augmentations' streams: after a checkpoint at step 3, releases 4 and 5 logged, a crash and a
    replay, step 6 and on are what the uninterrupted run computed."""
    x, y = torch.randn(60, 6), torch.randint(0, 3, (60,))
    model_a, a = _private(method)
    for _ in range(7):
        _step(a, x, y)

    model_b, b = _private(method)
    for _ in range(3):
        _step(b, x, y)
    ckpt = _state(model_b, b)
    w = ReplayWriter(tmp_path, "run", layout_of(b.optimizer.params), 3)
    for s in (4, 5):
        _step(b, x, y)
        w.append(s, b.optimizer.released_update())
    w.flush()
    ledger = b.ledger  # the journal's ledger: every release so far, once
    del model_b, b  # the crash

    model_c, c = _private(method)
    c.ledger = c.optimizer.ledger = ledger
    model_c.load_state_dict(ckpt["model"])
    c.optimizer.load_state_dict(ckpt["opt"])
    c.sampler.load_state_dict(ckpt["sampler"])
    c.optimizer.augment.load_state_dict(ckpt["augment"])
    seg = read_segment(segment_path(tmp_path, 3), "run", 3, layout_of(c.optimizer.params))
    assert seg.steps == (4, 5)
    assert ledger.mark_replayed(3, 5) == 2
    sizes = [p.numel() for p in c.optimizer.params.values()]
    for i in range(len(seg.steps)):
        lot = c.sampler.sample()
        update = [t.view_as(p) for t, p in zip(seg.payload(i).split(sizes), c.optimizer.params.values())]
        c.optimizer.replay(update, x[lot])
    assert len(ledger) == 5  # nothing was released or recorded by the replay
    for _ in range(2):
        _step(c, x, y)
    for pa, pc in zip(model_a.parameters(), model_c.parameters()):
        assert torch.equal(pa, pc)
    assert torch.equal(
        a.optimizer.randomness.state_dict()["generator"], c.optimizer.randomness.state_dict()["generator"]
    )
    assert torch.equal(a.optimizer.augment.generator.get_state(), c.optimizer.augment.generator.get_state())
    assert [e.step for e in ledger.entries] == list(range(1, 8)) and len(a.ledger) == 7
    assert [e.replayed for e in ledger.entries] == [False] * 3 + [True] * 2 + [False] * 2
    (replayed_row,) = [r for r in ledger.runs() if r["replayed"]]
    assert (replayed_row["first_step"], replayed_row["last_step"], replayed_row["count"]) == (4, 5, 2)


def test_the_replayed_mark_survives_the_journal(tmp_path):
    journal = tmp_path / "ledger.journal.jsonl"
    ledger = dpcore.PrivacyLedger(8.0, 1e-5, journal=journal)
    event = dpcore.PrivacyEvent.dpsgd_step(1.1, 0.01)
    for s in range(1, 6):
        ledger.append(event, step=s, clip_norm=1.0)
    ledger.mark_replayed(2, 4)
    ledger.mark_rolled_back(4)
    again = dpcore.PrivacyLedger(8.0, 1e-5, journal=journal)
    assert [(e.step, e.status, e.replayed) for e in again.entries] == [
        (1, "committed", False),
        (2, "committed", False),
        (3, "committed", True),
        (4, "committed", True),
        (5, "rolled_back", False),
    ]
    assert again.epsilon() == ledger.epsilon()  # five releases, each counted once
