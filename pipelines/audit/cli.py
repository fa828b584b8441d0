"""``dp-platform audit``: a one-run training audit, or the distinguishing audit of one mechanism."""

from __future__ import annotations

import dpcore
from dpcore.readout import epsilon_text

from ..catalog import AUDIT_MECHANISMS as MECHANISMS
from ..config.options import Parser
from . import AUDIT_FAILED, audit_failed


def main(argv: list[str] | None = None, prog: str = "dp-platform audit") -> int:
    import sys
    import warnings

    p = Parser(
        prog=prog,
        description="Privacy audits. With a training config: one training run with white-box gradient canaries "
        "(Steinke et al. 2023), ε_lb logged to MLflow beside ε. With --mechanism: the distinguishing audit of one "
        "release of a mechanism, repeated, against its ledger ε.",
    )
    p.add_argument("config", nargs="?", help="YAML training config (one-run audit)")
    p.add_argument(
        "--mechanism", choices=MECHANISMS, help="audit one release of this mechanism instead of a training run"
    )
    p.add_argument(
        "--workers", type=int, default=1, help="mechanism audit: 1, or 2 (gloo processes / two partial sums)"
    )
    p.add_argument("--repetitions", type=int, default=500, help="mechanism audit: independent releases")
    p.add_argument("--dim", type=int, default=2000, help="mechanism audit: coordinates per release")
    p.add_argument("--canaries", type=int, default=400, help="mechanism audit: canary coordinates per release")
    p.add_argument("--sigma", type=float, default=1.5, help="mechanism audit: the noise multiplier σ (b/C for Laplace)")
    p.add_argument("--sample-rate", type=float, default=1.0, help="mechanism audit: Poisson rate q")
    p.add_argument("--delta", type=float, default=1e-3, help="mechanism audit: δ at which ε and ε_lb are compared")
    from ..config import add_config_arguments

    add_config_arguments(p)
    args = vars(p.parse_args(argv))
    mechanism = args.pop("mechanism")
    mech_args = {
        k: args.pop(k)
        for k in ("workers", "repetitions", "dim", "canaries", "sigma", "sample_rate", "delta")
        if k in args
    }
    config_path = args.pop("config")
    try:
        if mechanism is not None:
            if config_path:
                raise dpcore.DPConfigError("give a training config (one-run audit) or --mechanism, not both.")
            with warnings.catch_warnings():
                warnings.simplefilter(
                    "ignore", dpcore.SeededRandomnessWarning
                )  # the mechanism audit is seeded on purpose
                from .mechanisms import mechanism_audit  # torch: after the flags are parsed

                res = mechanism_audit(
                    mechanism,
                    dim=mech_args["dim"],
                    canaries=mech_args["canaries"],
                    repetitions=mech_args["repetitions"],
                    noise_multiplier=mech_args["sigma"],
                    sample_rate=mech_args["sample_rate"],
                    delta=mech_args["delta"],
                    workers=mech_args["workers"],
                )
            print(
                f"{res.mechanism} ({res.workers} worker(s)): ε_lb = {res.epsilon_lower_bound:.3f} at {res.confidence:.0%} confidence, "
                f"ledger ε = {epsilon_text(res.epsilon, '.3f')} at δ={res.delta:g}; "
                f"{res.samples_in} 'in' and {res.samples_out} 'out' scores"
            )
            print("ok: ε_lb ≤ ε" if res.epsilon_lower_bound <= res.epsilon else "AUDIT FAILED: ε_lb > ε")
            return 0 if res.epsilon_lower_bound <= res.epsilon else AUDIT_FAILED
        from ..train import print_summary, run

        out = run(audit_config(config_path, args))
    except dpcore.DPError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_summary(out)
    return AUDIT_FAILED if audit_failed(out) else 0


def audit_config(config_path, args: dict):
    """The run ``dp-platform audit CONFIG`` trains: the config with its flags, and m = 1000
    canaries where neither the flags nor the YAML give ``audit_canaries`` (helper-43: the
    default was put among the flags, which override the YAML, so a YAML's m was ignored)."""
    from ..config import load_config

    cfg = load_config(config_path, args)
    if cfg.audit_canaries == 0 and "audit_canaries" not in args:
        cfg = load_config(config_path, {**args, "audit_canaries": 1000})
    if cfg.audit_canaries == 0:
        raise dpcore.DPConfigError("audit_canaries=0 turns the audit off; give m ≥ 2 canaries.")
    return cfg
