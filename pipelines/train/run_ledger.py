"""The run's ledger on the workers: rank 0 alone holds the journal (under an exclusive lock) and
decides how many more steps the budget allows; every rank gets that number."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..plan import RunPlan

import os
import time
from pathlib import Path

import torch.distributed as dist

import dpcore
from dpcore.ledger import COMMITTED

_JOURNAL_LOCK = None  # the open lock file of this process's journal (rank 0); released when the process dies
# A holder for less than this is waited for: journal_is_locked (a resume's check) takes the lock
# for an instant, and a restarting rank 0 that met it then failed, using up one of max_failures.
LOCK_WAIT_S = 1.0


def lock_journal(journal: str) -> None:
    """Take the run's exclusive journal lock for this process (rank 0) or fail: two worker
    groups appending to one journal would each check the budget against only their own
    releases. The lock is released by the OS when the process ends, however it ends."""
    import fcntl

    global _JOURNAL_LOCK
    if _JOURNAL_LOCK is not None and _JOURNAL_LOCK.name == journal + ".lock":
        return
    f = open(journal + ".lock", "a+")
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                f.close()
                raise dpcore.DPConfigError(
                    f"another process holds the ledger journal {journal} of this run (an earlier driver's workers are "
                    "still training?). Stop them first; two trainers on one journal could spend the budget twice."
                ) from None
            time.sleep(0.02)
    _JOURNAL_LOCK = f


def unlock_journal() -> None:
    global _JOURNAL_LOCK
    if _JOURNAL_LOCK is not None:
        _JOURNAL_LOCK.close()  # closing the file releases its flock
        _JOURNAL_LOCK = None


def journal_is_locked(journal: str) -> bool:
    import fcntl

    if not Path(journal + ".lock").exists():
        return False
    with open(journal + ".lock", "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return False


def prior_groups(plan: RunPlan) -> list:
    """The releases of a run before its first step: DP-PCA's, if the run has one."""
    cfg = plan.config
    return [(dpcore.pca.pca_event(cfg["pca_noise_multiplier"], cfg["pca_sample_rate"]), 1)] if plan.pca_path else []


def plds_for_workers(plan: RunPlan) -> list:
    """The PLDs of the run's events that the driver built while planning, for its workers'
    ledgers (:func:`dpcore.accountants.pld.import_base_plds`); empty for other accountants."""
    if plan.config["accountant"] != "pld":
        return []
    from dpcore.accountants.pld import export_base_plds

    return export_base_plds([event for event, _ in prior_groups(plan)] + [plan.step_event()])


def open_ledger(
    plan: RunPlan, checkpoint_meta: dict | None, checkpoint_ledger: dict | None, rank: int, world: int, layout: list
) -> tuple[dpcore.PrivacyLedger, int, int, object]:
    """Open the run's ledger, decide which releases since the checkpoint the replay log carries,
    and how many more steps fit. Returns (ledger, allowance, upto, segment): the workers replay
    the logged updates of the steps after the checkpoint up to ``upto`` (rank 0 reads them from
    ``segment``), then train from ``upto + 1``.

    Rank 0 is the only budget authority: it locks and opens the journal that the driver
    created (every release so far), checks it against the checkpoint, marks the releases after
    the checkpoint that the replay log holds as replayed (:mod:`.replay`) and the others as
    rolled back, computes how many more releases fit the budget, and broadcasts both numbers,
    so that every rank stops at the same step. Ranks ≥ 1 add no noise and keep a budget-free
    ledger only for their optimizer's bookkeeping.
    """
    from . import replay

    cfg = plan.config
    allowance = upto = segment = None
    if rank == 0:
        journal = plan.journal
        if not os.path.isfile(journal):
            raise dpcore.DPConfigError(
                f"the ledger journal {journal} does not exist on this node. The driver creates it before training; "
                "storage_path must be storage that every node shares. Refusing to train without the run's ledger."
            )
        lock_journal(journal)
        ledger = dpcore.PrivacyLedger(
            cfg["target_epsilon"],
            cfg["target_delta"],
            cfg["accountant"],
            epsilon_every=plan.epsilon_every,
            journal=journal,
        )
        if checkpoint_ledger is not None and len(ledger) < len(checkpoint_ledger["entries"]):
            raise dpcore.DPConfigError(
                f"the ledger journal {journal} holds {len(ledger)} releases but the checkpoint holds "
                f"{len(checkpoint_ledger['entries'])}: the journal was lost or truncated, so releases after the "
                "checkpoint cannot be accounted for. Refusing to resume."
            )
        if plan.pca_path and not any(e.step == 0 for e in ledger.entries):
            raise dpcore.DPConfigError(
                f"the run uses a DP-PCA projection but its ledger journal {journal} holds no release for it. "
                "Refusing to train on a projection that is not accounted for."
            )
        if plan.max_releases is not None:  # the driver's plan: the budget check need not search again
            ledger.prime_allowance(plan.step_event(), prior_groups(plan), plan.max_releases)
        after = checkpoint_meta["step"] if checkpoint_meta is not None else 0
        segment, upto = replay.replayable(plan, ledger, after, layout)
        if upto > after:
            ledger.mark_replayed(after, upto)
        if any(e.status == COMMITTED and e.step > upto for e in ledger.entries):
            ledger.mark_rolled_back(upto)
        left = ledger.allowance(plan.step_event())
        allowance = int(min(max(left, 0), plan.steps - upto))
    else:
        ledger = dpcore.PrivacyLedger(None, cfg["target_delta"], cfg["accountant"], epsilon_every=10**9)
    if world > 1:
        box = [allowance, upto]
        dist.broadcast_object_list(box, src=0)
        allowance, upto = box
    return ledger, allowance, upto, segment
