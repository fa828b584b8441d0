"""Privacy audits: the one-run training audit (canaries in a real run) and the distinguishing
audit of one release of each mechanism (:mod:`.mechanisms`); ``dp-platform audit`` is :mod:`.cli`."""

from .mechanisms import (
    MECHANISMS,
    MechanismAudit,
    claimed_epsilon,
    mechanism_audit,
    mechanism_audits,
    mechanism_scores,
)

__all__ = ["MECHANISMS", "MechanismAudit", "claimed_epsilon", "mechanism_audit", "mechanism_audits", "mechanism_scores"]
