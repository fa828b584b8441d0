"""What a person reads of a ledger: one row per run of identical releases, or plain columns."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict

from ..events import PrivacyEvent

COLUMNS = (
    "index",
    "step",
    "kind",
    "sample_rate",
    "noise_multiplier",
    "clip_norm",
    "status",
    "replayed",
    "epsilon",
    "delta",
    "accountant",
)
# (Not the wall-clock time of each release, which the journal keeps for the progress bar: the
# time between two releases follows the realised lot or round size, which is not released.)


def runs(ledger) -> list[dict]:
    """One row per run of consecutive releases that are identical (kind, q, σ, C, status,
    replayed after a restart or not),
    like dp_accounting's self-composed events, with the run's count, first and last step, and
    the cumulative ε after its last release (one composition per row, not per release)."""
    rows: list[dict] = []
    counts: Counter[PrivacyEvent] = Counter()
    for e in ledger.entries:
        key = (e.kind, e.sample_rate, e.noise_multiplier, e.clip_norm, e.status, e.replayed)
        if rows and rows[-1]["_key"] == key:
            rows[-1]["count"] += 1
            rows[-1]["last_step"] = e.step
        else:
            rows.append(
                {
                    "_key": key,
                    "kind": e.kind,
                    "count": 1,
                    "first_step": e.step,
                    "last_step": e.step,
                    "sample_rate": e.sample_rate,
                    "noise_multiplier": e.noise_multiplier,
                    "clip_norm": e.clip_norm,
                    "status": e.status,
                    "replayed": e.replayed,
                }
            )
        counts[e.event] += 1
        rows[-1]["_counts"] = Counter(counts)
    for r in rows:
        del r["_key"]
        r["epsilon_after"] = ledger.epsilon_of(r.pop("_counts"))
        r["delta"] = ledger.target_delta
        r["accountant"] = ledger.accountant
    return rows


def columns(ledger) -> dict[str, list]:
    """Plain columns (lists of Python scalars), one row per release, ready for
    ``pyarrow.table``. ε is NaN where it was not computed (see ``epsilon_every``)."""
    cols: dict[str, list] = {c: [] for c in COLUMNS}
    for e in ledger.entries:
        d = asdict(e)
        for c in COLUMNS:
            v = d[c]
            cols[c].append(float("nan") if (c == "epsilon" and v is None) else v)
    return cols
