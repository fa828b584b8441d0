"""The privacy ledger: every noisy release of a run, its budget, and the ε that follows.

* :mod:`.ledger`: :class:`PrivacyLedger` (entries, the exact budget check, ε composed lazily,
  rollback, checkpoint state);
* :mod:`.journal`: the append-only, fsynced file that keeps releases across crashes;
* :mod:`.views`: what a person reads (one row per run of identical releases; columns).
"""

from .ledger import COMMITTED, ROLLED_BACK, LedgerEntry, PrivacyLedger
from .views import COLUMNS

__all__ = ["COLUMNS", "COMMITTED", "ROLLED_BACK", "LedgerEntry", "PrivacyLedger"]
