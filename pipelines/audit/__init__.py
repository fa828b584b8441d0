"""Privacy audits: the one-run training audit (canaries in a real run) and the distinguishing
audit of one release of each mechanism (:mod:`.mechanisms`); ``dp-platform audit`` is :mod:`.cli`."""

from dpcore.readout import epsilon_text

_NAMES = ("MECHANISMS", "MechanismAudit", "claimed_epsilon", "mechanism_audit", "mechanism_audits", "mechanism_scores")


def __getattr__(name: str):  # loaded on first use: `dp-platform audit --help` imports no torch
    if name in _NAMES:
        from . import mechanisms

        return getattr(mechanisms, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


AUDIT_FAILED = 3  # the exit status of a command whose audit found ε_lb > ε


def one_run_audit_lines(out: dict, canaries: str) -> list[tuple[str, bool]]:
    """The summary's lines for a run's one-run audit (none without one), each with whether it
    goes to stderr: the result, and where ε_lb > ε a line saying the audit failed.
    ``canaries`` names them ("gradient canaries", "canary clients")."""
    a = out.get("audit")
    if not a:
        return []
    above = a["epsilon_lower_bound"] > out["epsilon"]
    lines = [
        (
            f"audit (one run, {a['canaries']} {canaries}, {a['guesses']} guesses): {a['correct']} correct -> "
            f"ε_lb = {a['epsilon_lower_bound']:.3f} at {a['confidence']:.0%} confidence "
            f"({'ABOVE' if above else '≤'} ε = {epsilon_text(out['epsilon'], '.3f')})",
            False,
        )
    ]
    if above:
        lines.append(
            (
                "AUDIT FAILED: ε_lb > ε. At this confidence a run that meets its ε fails this check 1 time in 20 at "
                "most; look for a bug before trusting the run (docs/audit.md). Exit status 3.",
                True,
            )
        )
    return lines


def audit_failed(out: dict) -> bool:
    a = out.get("audit")
    return bool(a) and a["epsilon_lower_bound"] > out["epsilon"]


__all__ = [*_NAMES, "AUDIT_FAILED", "audit_failed", "one_run_audit_lines"]
