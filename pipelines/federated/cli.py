"""``dp-platform federated`` and ``python -m pipelines.federated``."""

from __future__ import annotations

import argparse
import sys
import warnings

import dpcore
from dpcore.readout import epsilon_text

from ..config import add_config_arguments, load_config
from ..config.options import config_parser
from .config import FederatedConfig


# ------------------------------------------------------------------------------------------
def build_parser(prog: str = "python -m pipelines.federated") -> argparse.ArgumentParser:
    p = config_parser(
        prog,
        "Client-level (ε, δ)-DP federated averaging (DP-FedAvg, Geyer et al. 2017 / McMahan et al. 2018) with "
        "clients simulated on Ray actors; the ledger, metrics and model go to MLflow.",
    )
    add_config_arguments(p, FederatedConfig)
    return p


def main(argv: list[str] | None = None, prog: str = "python -m pipelines.federated") -> int:
    args = vars(build_parser(prog).parse_args(argv))
    config_path = args.pop("config")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("once", dpcore.SeededRandomnessWarning)
            cfg = load_config(config_path, args, cls=FederatedConfig)
            cfg.validate()  # before the log folder under storage_path is made: a refused path leaves nothing
            import mlflow  # noqa: F401  (torch, Ray and MLflow: after the flags are parsed; imported before
            import ray  # noqa: F401  their logging is routed, since importing them configures it)

            from ..logs import library_logs, log_path, meaning_warnings
            from .rounds import run_federated

            with library_logs(log_path(cfg.storage_path, "federated"), keep=meaning_warnings()) as logs:
                out = run_federated(cfg)
    except dpcore.DPError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        import traceback

        traceback.print_exc(limit=3)
        print(f"error: federated training failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(
        f"run {out['run_id']}  dataset={out['dataset']}  K={out['num_clients']} clients, "
        f"m={out['clients_per_round']:g} expected per round  "
        f"rounds={out['rounds']}/{out['planned_rounds']}  z={out['noise_multiplier']:.4f}"
        + (
            f" (update noise {out['update_noise_multiplier']:.4f})"
            if out["update_noise_multiplier"] != out["noise_multiplier"]
            else ""
        )
    )
    print(f"test accuracy: {out['test_accuracy']:.4f}")
    print(
        f"ε spent: {epsilon_text(out['epsilon'], '.4f')} at δ={out['target_delta']:g}; δ at ε={out['target_epsilon']:g}: "
        f"{out['delta_at_target_epsilon']:.3g} "
        "(client-level, add/remove one client, Poisson sampling of clients)"
    )
    print(
        f"communication (expected): {out['comm_expected_bytes'] / 1e6:.1f} MB  actor restarts: {out['actor_restarts']}  "
        f"time: {out['seconds']:.1f}s ({out['rounds'] / max(out['seconds_rounds'], 1e-9):.2f} rounds/s)"
    )
    from ..audit import AUDIT_FAILED, audit_failed, one_run_audit_lines

    for line, to_stderr in one_run_audit_lines(out, "canary clients"):
        print(line, file=sys.stderr if to_stderr else sys.stdout)
    if out["registered_model"]:
        print(f"model: {out['registered_model']} in the MLflow registry")
    logs.print_report("MLflow, Ray")
    if cfg.diagnostics:
        print(
            "warning: NON-PRIVATE diagnostics were on: realised clients, bytes and update norms are logged without "
            "noise and are not covered by ε (tag dp.diagnostics=non-private)"
        )
    from ..train import ui_command

    print(f"open the UI: {ui_command(out['tracking_uri'])}")
    return AUDIT_FAILED if audit_failed(out) else 0


if __name__ == "__main__":
    sys.exit(main())
