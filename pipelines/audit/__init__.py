"""Privacy audits: the one-run training audit (canaries in a real run) and the distinguishing
audit of one release of each mechanism (:mod:`.mechanisms`); ``dp-platform audit`` is :mod:`.cli`."""

_NAMES = ("MECHANISMS", "MechanismAudit", "claimed_epsilon", "mechanism_audit", "mechanism_audits", "mechanism_scores")


def __getattr__(name: str):  # loaded on first use: `dp-platform audit --help` imports no torch
    if name in _NAMES:
        from . import mechanisms

        return getattr(mechanisms, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_NAMES)
