"""The privacy ledger: an append-only record of every noisy release of a run.

Each entry holds the step, the event kind, q, the noise multiplier σ, the clipping bound C,
its status (``committed`` or ``rolled_back``), whether a restart replayed it, and the cumulative ε at the run's δ computed
by the ledger's accountant. The ε a run reports is computed from the ledger alone.

Cost of ε: an exact PLD evaluation takes 0.1–0.5 s, too slow for every step. By default
(``epsilon_every=None``) the cumulative ε is computed on the first entry of each kind of event
and when :meth:`epsilon` is called (which fills the latest entry); ``epsilon_every=k`` also
computes it on every k-th entry. Other entries keep ``epsilon=None`` (NaN in the exported
columns). The budget check is exact for every release regardless (:meth:`check`).

Restarts: a checkpoint's ``state_dict`` is older than the last release, so on its own it would
forget the releases made after it. A ledger with a ``journal`` therefore writes every entry
(and every rollback) to an append-only JSON-lines file, flushed and fsynced before
:meth:`append` returns — that is, before the step's result can be checkpointed, evaluated or
logged. A ledger opened on an existing journal restores every release from it; the caller
then marks the releases after the restored checkpoint with :meth:`mark_rolled_back`. They
stay in the ledger and are counted in ε (their noise was released, even if the resulting
parameters were discarded); the re-run steps are appended again as committed entries. With a
replay log (:mod:`.replay`), the releases it kept are instead applied again to the restored
state and marked with :meth:`mark_replayed`: they stay committed, are counted once, and no
step is released twice; only the releases the log lacks are rolled back.
:meth:`load_state_dict` refuses a state that would drop releases the ledger already holds, or
whose releases do not begin with them (another history), and writes the state's further
releases to the journal before it takes them, so that a later restart, which reads only the
journal, counts them too.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from .. import accountants
from ..accountants import calibration, check_accountant
from ..errors import BudgetExceededError, DPConfigError
from ..events import PrivacyEvent, compose
from ..readout import epsilon_text
from ..validation import check_clip_norm, check_delta, check_epsilon
from . import views
from .journal import Journal

COMMITTED = "committed"
ROLLED_BACK = "rolled_back"


def _identity(entry: dict) -> tuple:
    """What makes two ledger entries the same release (not when it was recorded or its ε)."""
    return tuple(
        entry[k]
        for k in ("index", "step", "kind", "sample_rate", "noise_multiplier", "clip_norm", "status", "replayed")
    )


@dataclass
class LedgerEntry:
    index: int
    step: int
    kind: str
    sample_rate: float
    noise_multiplier: float
    clip_norm: float
    status: str = COMMITTED
    replayed: bool = False  # applied again from the replay log after a restart (released once)
    epsilon: float | None = None
    delta: float = 0.0
    accountant: str = "pld"
    timestamp: float = field(default_factory=time.time)

    @property
    def event(self) -> PrivacyEvent:
        return PrivacyEvent.of(self.kind, self.noise_multiplier, self.sample_rate)


class PrivacyLedger:
    """Append-only ledger with a budget.

    Args:
        target_epsilon: the run's budget ε. Releases that would exceed it are refused.
            ``None`` means no budget (the ledger still records and reports ε).
        target_delta: the run's δ.
        accountant: ``"pld"`` (default, tight), ``"rdp"`` or ``"moments"``.
        epsilon_every: ``None`` (default): compute the cumulative ε only when asked
            (:meth:`epsilon`) and on the first entry of each kind of event; ``k``: also on every
            k-th entry (see module doc).
        journal: the path of the append-only journal (see module doc); an existing one is resumed.
        read_only: read an existing journal that another process writes (the driver reporting
            its workers' releases): nothing is recorded, and a torn last line is left as it is.
    """

    def __init__(
        self,
        target_epsilon: float | None,
        target_delta: float,
        accountant: str = "pld",
        epsilon_every: int | None = None,
        dataset_size: int | None = None,
        journal: str | os.PathLike | None = None,
        read_only: bool = False,
    ):
        self.target_epsilon = None if target_epsilon is None else check_epsilon(target_epsilon)
        self.target_delta = check_delta(target_delta, dataset_size=dataset_size)
        self.accountant = check_accountant(accountant)
        if epsilon_every is not None and (
            isinstance(epsilon_every, bool) or not isinstance(epsilon_every, int) or epsilon_every < 1
        ):
            raise DPConfigError(
                f"epsilon_every={epsilon_every!r} is invalid: it must be None (only when asked) or an integer ≥ 1."
            )
        self.epsilon_every = epsilon_every
        self._entries: list[LedgerEntry] = []
        self._counts: Counter[PrivacyEvent] = Counter()
        self._allowance_cache: dict[tuple, int] = {}
        self._eps_cache: dict[tuple, float] = {}
        self._composable: set[PrivacyEvent] = set()  # events check() found the accountant can compose
        self.journal = None if journal is None else os.fspath(journal)
        self._journal = None if journal is None else Journal(journal)
        self.read_only = read_only
        if read_only and (self._journal is None or not self._journal.exists()):
            raise DPConfigError(f"a read-only ledger needs an existing journal; {journal!r} is not one.")
        if self._journal is not None:
            if self._journal.exists():
                self._replay(self._journal.read(repair=not read_only))
            else:
                self._write({"op": "header", **self._budget()})

    # ----------------------------------------------------------------------------------
    def _budget(self) -> dict:
        return {"target_epsilon": self.target_epsilon, "target_delta": self.target_delta, "accountant": self.accountant}

    def _refuse_if_read_only(self) -> None:
        if self.read_only:
            raise DPConfigError(f"this ledger reads the journal {self.journal} of another process; it records nothing.")

    def _write(self, record: dict) -> None:
        self._refuse_if_read_only()
        if self._journal is not None:
            self._journal.write(record)

    def _replay(self, records: list[dict]) -> None:
        header = records[0] if records else {}
        mine = self._budget()
        if header.get("op") != "header" or any(header.get(k) != v for k, v in mine.items()):
            raise DPConfigError(
                f"ledger journal {self.journal} belongs to a run with a different budget, δ or accountant "
                f"({ {k: header.get(k) for k in mine} }) than this one ({mine}); a resumed run keeps all three."
            )
        for r in records[1:]:
            if r["op"] == "append":
                entry = LedgerEntry(**{k: v for k, v in r.items() if k != "op"})
                self._entries.append(entry)
                self._counts[entry.event] += 1
            elif r["op"] == "rollback":
                self._apply_rollback(r["after_step"])
            elif r["op"] == "replayed":
                self._apply_replayed(r["after_step"], r["upto_step"])

    # ----------------------------------------------------------------------------------
    @property
    def entries(self) -> tuple[LedgerEntry, ...]:
        return tuple(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def groups(self) -> list[tuple[PrivacyEvent, int]]:
        """Every release (committed and rolled back), grouped as (event, count)."""
        return sorted(self._counts.items(), key=lambda kv: repr(kv[0]))

    def epsilon_of(self, counts: Counter) -> float:
        """ε of the releases ``counts`` (event → count) with this ledger's δ and accountant, cached."""
        key = tuple(sorted(((repr(e), c) for e, c in counts.items() if c > 0)))
        if key not in self._eps_cache:
            self._eps_cache[key] = accountants.epsilon(list(counts.items()), self.target_delta, self.accountant)
        return self._eps_cache[key]

    def epsilon(self) -> float:
        """The cumulative ε of every release so far, at the run's δ. Also stored on the last entry."""
        eps = self.epsilon_of(self._counts)
        if self._entries:
            self._entries[-1].epsilon = eps
        return eps

    def to_dp_event(self):
        """The whole ledger as one dp_accounting event (for an independent check)."""
        return compose(self.groups())

    # ----------------------------------------------------------------------------------
    def _allowance_key(self, event: PrivacyEvent, others) -> tuple:
        return (tuple(sorted((repr(e), c) for e, c in others if e != event and c > 0)), event)

    def prime_allowance(self, event: PrivacyEvent, other_groups, max_count: int) -> None:
        """Seed the budget check with ``max_count`` = :func:`dpcore.accountants.calibration.max_steps` of ``event``
        next to ``other_groups``, computed elsewhere (the driver's plan) with this ledger's
        budget, δ and accountant. It is used only while the ledger's other releases are exactly
        ``other_groups``; any other history is computed afresh, as always. The cache holds the
        most releases of ``event`` in all, so releases of ``event`` among ``other_groups`` (a
        DP-PCA release identical to a step) are added to ``max_count``. The count is checked
        once, by ε of all those releases with this ledger's accountant: one over the budget is
        refused (:class:`DPConfigError`), never cached."""
        total = Counter()  # the history, each event once (as the ledger's own counts are kept)
        for e, c in other_groups:
            total[e] += c
        same = total[event]
        total[event] = int(max_count) + same
        if self.target_epsilon is not None:
            # Trusted no further than one evaluation with this ledger's own accountant: the budget
            # check reads the count from the cache, so a count over the budget would let releases
            # past it (a plan made with another δ or accountant, or a caller's slip).
            spent = self.epsilon_of(total)
            if spent > self.target_epsilon:
                raise DPConfigError(
                    f"the planned {max_count} releases of {event.kind} (q={event.sample_rate:.4g}, "
                    f"σ={event.noise_multiplier:.4g}) beside the run's other releases would spend "
                    f"ε={spent:.6g} > target ε={self.target_epsilon:g} at δ={self.target_delta:g} "
                    f"({self.accountant}): the plan does not fit this ledger's budget."
                )
        self._allowance_cache[self._allowance_key(event, total.items())] = int(max_count) + same

    def allowance(self, event: PrivacyEvent) -> int | float:
        """How many more releases of ``event`` fit in the budget given everything so far."""
        if self.target_epsilon is None:
            return math.inf
        key = self._allowance_key(event, self._counts.items())
        if key not in self._allowance_cache:
            prior = [(e, c) for e, c in self._counts.items() if e != event and c > 0]
            self._allowance_cache[key] = calibration.max_steps(
                event.noise_multiplier,
                event.sample_rate,
                self.target_epsilon,
                self.target_delta,
                accountant=self.accountant,
                prior_groups=prior,
                event=event,
            )
        return self._allowance_cache[key] - self._counts[event]

    def check(self, event: PrivacyEvent, count: int = 1) -> None:
        """Raise :class:`BudgetExceededError` if ``count`` more releases of ``event`` would take
        ε past the target. Exact: it compares against the largest count that fits, found by
        bisection with the ledger's accountant (cached per event and history). With or without a
        budget, an event the accountant cannot compose (σ too small for the PLD) raises DPConfigError."""
        if self.target_epsilon is not None:
            left = self.allowance(event)
            if count > left:
                raise BudgetExceededError(
                    f"Refused: {count} more release(s) of {event.kind} (q={event.sample_rate:.4g}, "
                    f"σ={event.noise_multiplier:.4g}) would take ε past the budget "
                    f"ε={self.target_epsilon:g} at δ={self.target_delta:g} ({max(0, left)} more fit; "
                    f"ε spent so far {epsilon_text(self.epsilon(), '.4g')}). Nothing was released."
                )
        self._check_composable(event, count)

    def _check_composable(self, event: PrivacyEvent, count: int = 1) -> None:
        if event not in self._composable:  # a release on the whole dataset: its span grows with the count
            accountants.check_composable(event, self.accountant, self._counts[event] + count)
            if event.sampled:
                self._composable.add(event)

    def append(self, event: PrivacyEvent, step: int, clip_norm: float, check_budget: bool = True) -> LedgerEntry:
        """Record one release. With ``check_budget`` (default) it is refused if over budget.

        Callers must call :meth:`check` *before* releasing anything; ``append`` re-checks so
        that the ledger can never hold an entry past the budget.
        """
        self._refuse_if_read_only()  # before anything changes
        check_clip_norm(clip_norm)
        if check_budget:
            self.check(event)
        else:
            self._check_composable(event)
        counts = self._counts.copy()  # ε first, then the journal: a failure leaves nothing changed
        counts[event] += 1
        entry = LedgerEntry(
            index=len(self._entries),
            step=int(step),
            kind=event.kind,
            sample_rate=event.sample_rate,
            noise_multiplier=event.noise_multiplier,
            clip_norm=float(clip_norm),
            delta=self.target_delta,
            accountant=self.accountant,
        )
        if counts[event] == 1 or (self.epsilon_every is not None and (entry.index + 1) % self.epsilon_every == 0):
            entry.epsilon = self.epsilon_of(counts)
        self._write({"op": "append", **asdict(entry)})
        self._counts = counts
        self._entries.append(entry)
        return entry

    def mark_rolled_back(self, after_step: int) -> int:
        """Mark every committed entry with step > ``after_step`` as rolled back. Returns how many.

        Rolled-back entries stay in the ledger and are still counted in ε.
        """
        self._refuse_if_read_only()  # before anything changes
        n = self._apply_rollback(after_step)
        self._write({"op": "rollback", "after_step": int(after_step)})
        return n

    def mark_replayed(self, after_step: int, upto_step: int) -> int:
        """Mark the committed entries of steps ``after_step < step ≤ upto_step`` as replayed: a
        restart applied them again from the replay log. They stay committed and are counted once
        (nothing is released again). Returns how many."""
        self._refuse_if_read_only()  # before anything changes
        n = self._apply_replayed(after_step, upto_step)
        self._write({"op": "replayed", "after_step": int(after_step), "upto_step": int(upto_step)})
        return n

    def _apply_replayed(self, after_step: int, upto_step: int) -> int:
        n = 0
        for e in self._entries:
            if e.status == COMMITTED and after_step < e.step <= upto_step:
                e.replayed = True
                n += 1
        return n

    def _apply_rollback(self, after_step: int) -> int:
        n = 0
        for e in self._entries:
            if e.status == COMMITTED and e.step > after_step:
                e.status = ROLLED_BACK
                n += 1
        return n

    def committed_steps(self) -> list[int]:
        """The training steps (step ≥ 1) whose releases are committed. Releases made before
        training (step 0, such as a DP-PCA projection) are in the ledger but are not steps."""
        return [e.step for e in self._entries if e.status == COMMITTED and e.step > 0]

    # ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "version": 1,
            "target_epsilon": self.target_epsilon,
            "target_delta": self.target_delta,
            "accountant": self.accountant,
            "epsilon_every": self.epsilon_every,
            "entries": [asdict(e) for e in self._entries],
        }

    def load_state_dict(self, state: dict) -> None:
        self._refuse_if_read_only()
        if state.get("version") != 1:
            raise DPConfigError(f"unknown ledger state version {state.get('version')!r}.")
        mine = self._budget()
        if any(state[k] != v for k, v in mine.items()):
            raise DPConfigError(
                f"the saved ledger was kept with another budget, δ or accountant ({ {k: state[k] for k in mine} }) "
                f"than this one ({mine}); a resumed run keeps all three."
            )
        if len(state["entries"]) < len(self._entries):
            raise DPConfigError(
                f"refusing to load a ledger state with {len(state['entries'])} releases into a ledger that "
                f"already holds {len(self._entries)} (from its journal): that would forget releases that "
                "happened. To resume from an older checkpoint, keep this ledger and call "
                "mark_rolled_back(checkpoint_step)."
            )
        # Everything in the state is checked before anything is written or taken.
        try:
            entries = [LedgerEntry(**e) for e in state["entries"]]
            counts = Counter(e.event for e in entries)
        except (TypeError, ValueError, KeyError, DPConfigError) as err:
            raise DPConfigError(f"the saved ledger holds a release this version cannot read: {err}") from None
        for i, e in enumerate(entries):
            if e.index != i or e.status not in (COMMITTED, ROLLED_BACK):
                raise DPConfigError(
                    f"the saved ledger's release {i} is malformed (index {e.index}, status {e.status!r})."
                )
        held = [_identity(asdict(e)) for e in self._entries]
        theirs = [_identity(asdict(e)) for e in entries[: len(held)]]
        if theirs != held:
            same_releases = [t[:6] for t in theirs] == [h[:6] for h in held]
            raise DPConfigError(
                "refusing to load a ledger state whose releases' status (rolled back, replayed) differs from this "
                "ledger's journal: the journal is later than the checkpoint. Keep this ledger and call "
                "mark_rolled_back(checkpoint_step) to resume from the checkpoint."
                if same_releases
                else "refusing to load a ledger state whose releases do not begin with the ones this ledger already "
                "holds (from its journal): it comes from another history, and loading it would forget releases "
                "that happened."
            )
        # The journal must hold every release the ledger counts: a later restart reads only the
        # journal. The state's releases beyond it are written there first (fsynced, as append does).
        for e in entries[len(held) :]:
            self._write({"op": "append", **asdict(e)})
        self.epsilon_every = state["epsilon_every"]
        self._entries = entries
        self._counts = counts
        self._allowance_cache.clear()

    def runs(self) -> list[dict]:
        """The ledger for a person to read: one row per run of identical releases (:func:`.views.runs`)."""
        return views.runs(self)

    def to_columns(self) -> dict[str, list]:
        """Plain columns, one row per release, ready for ``pyarrow.table`` (:func:`.views.columns`)."""
        return views.columns(self)
