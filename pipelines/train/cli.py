"""``dp-platform train`` and ``python -m pipelines.train``: the command line of the main job.

dp-platform train                               # digits, 2 workers, ε=2, δ=1e-5, ./mlflow.db
dp-platform train run.yaml --target-epsilon 8   # a YAML config plus flag overrides
python -m pipelines.train run.yaml              # the same; also the entrypoint for `ray job submit`
dp-platform train --resume <mlflow run id>      # continue a run after the driver died
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import dpcore
from dpcore.readout import epsilon_text

from .. import tracking
from ..config import add_config_arguments, load_config
from ..config.options import config_parser
from .resume import RESUME_MAY_CHANGE


def build_parser(prog: str = "python -m pipelines.train") -> argparse.ArgumentParser:
    p = config_parser(
        prog,
        "Train a model with example-level (ε, δ)-differential privacy (DP-SGD family) on Ray Train "
        "workers, and log the run's privacy ledger, metrics and model to MLflow. ε is computed from the ledger.",
    )
    p.add_argument(
        "--resume",
        metavar="RUN_ID",
        help="continue an unfinished MLflow run from its last checkpoint and ledger journal",
    )
    add_config_arguments(p)
    return p


def main(argv: list[str] | None = None, prog: str = "python -m pipelines.train") -> int:
    started = time.monotonic()
    args = vars(build_parser(prog).parse_args(argv))
    config_path, resume = args.pop("config"), args.pop("resume")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("once", dpcore.SeededRandomnessWarning)
            if resume is not None:
                changed = sorted(k for k in args if k not in RESUME_MAY_CHANGE + ("tracking_uri",))
                if config_path or changed:
                    raise dpcore.DPConfigError(
                        "--resume continues a run with the config it started with; only "
                        f"{', '.join('--' + k.replace('_', '-') for k in RESUME_MAY_CHANGE + ('tracking_uri',))} may be given "
                        f"(got {', '.join('--' + k.replace('_', '-') for k in changed) or config_path})."
                    )
            cfg = load_config(config_path, args)
            cfg.validate()  # before the log folder under storage_path is made: a refused path leaves nothing
            import mlflow  # noqa: F401  (torch, Ray and MLflow: after the flags are parsed; imported before
            import ray  # noqa: F401  their logging is routed, since importing them configures it)

            from ..logs import library_logs, log_path, meaning_warnings
            from .driver import run

            with library_logs(log_path(cfg.storage_path, "train"), keep=meaning_warnings()) as logs:
                if resume is None and cfg.seed is not None:
                    dpcore.make_randomness(cfg.seed)  # the warning, once, on the driver
                out = run(cfg, resume=resume, resume_changes={k: v for k, v in args.items() if k in RESUME_MAY_CHANGE})
            out["log"] = logs
    except dpcore.DPError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # Ray/MLflow failures: say what failed, keep the traceback short
        import traceback

        traceback.print_exc(limit=-4)
        print(f"error: training failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    out["wall_seconds"] = time.monotonic() - started
    print_summary(out)
    from ..audit import AUDIT_FAILED, audit_failed

    return AUDIT_FAILED if audit_failed(out) else 0


def print_summary(out: dict) -> None:
    print(
        f"run {out['run_id']}  dataset={out['dataset']} (N_train={out['train_examples']})  "
        f"workers={out['num_workers']} on {out.get('nodes', '?')} node(s)  "
        f"steps={out['steps']}/{out['planned_steps']}  q={out['sample_rate']:.4f}  σ={out['noise_multiplier']:.4f}  "
        f"randomness={out['randomness']}"
    )
    rounded = steps_note(out)
    if rounded:
        print(rounded)
    if out.get("replayed"):
        print(f"restarts replayed {out['replayed']} release(s) from the replay log; each was released and counted once")
    if out["rolled_back"]:
        print(f"restarts rolled back {out['rolled_back']} release(s); they stay in the ledger and are counted in ε")
    f1 = out.get("test_f1", float("nan"))
    f1_text = f"   test F1 of class 1 ({out['classes'][1]}): {f1:.4f}" if f1 == f1 and out.get("classes") else ""
    print(f"test accuracy: {out['test_accuracy']:.4f}{f1_text}   validation accuracy: {out['val_accuracy']:.4f}")
    print(
        f"ε spent: {epsilon_text(out['epsilon'], '.4f')} at δ={out['delta']:g} ({out['accountant']} accountant; example-level, add/remove, "
        "Poisson sampling)"
    )
    if out.get("audit"):
        from ..audit import one_run_audit_lines

        for line, to_stderr in one_run_audit_lines(out, f"{out['audit']['kind']} canaries"):
            print(line, file=sys.stderr if to_stderr else sys.stdout)
    if out["registered_model"]:
        print(f"model: {out['registered_model']} in the MLflow registry")
    if "wall_seconds" in out:
        print(
            f"time: {out['wall_seconds']:.1f}s from the command's start ({out['seconds']:.1f}s since the run's MLflow "
            "record was made: the progress line's clock)"
        )
    else:
        print(f"time: {out['seconds']:.1f}s since the run's MLflow record was made")
    if out.get("log") is not None:
        if out.get("in_process"):
            out["log"].print_report("MLflow, Ray", "; the training's own output is above")
        else:
            out["log"].print_report("MLflow, Ray", "; the workers' output is in Ray's session logs")
    if out.get("diagnostics"):
        print(
            "warning: NON-PRIVATE diagnostics were on: the run's training-set statistics (loss, accuracy, clip "
            "fractions) are logged without noise and are not covered by ε (tag dp.diagnostics=non-private)"
        )
    print(f"open the UI: {ui_command(out['tracking_uri'], out.get('experiment_id'), out['run_id'])}")


def steps_note(out: dict) -> str | None:
    """A line when the planned steps are far from the epochs asked for: ``--epochs 0.001`` at
    q = 0.41 is 0.0025 of a step, and a run takes at least one (0.41 epochs)."""
    epochs, q, planned = out.get("epochs"), out["sample_rate"], out["planned_steps"]
    if epochs is None or planned * q <= 1.5 * epochs:
        return None
    return (
        f"note: epochs={epochs:g} is {epochs / q:.3g} steps at q={q:.4f}; a run takes at least one step, so it "
        f"planned {planned} ({planned * q:.3g} epochs)"
    )


def cli_command() -> str:
    """``dp-platform`` as this shell can run it: the bare name when it is on PATH (an active
    venv), else the path of the one installed beside this Python (``.venv/bin/dp-platform``)."""
    import os
    import shutil
    from pathlib import Path

    beside = Path(sys.executable).parent / "dp-platform"
    on_path = shutil.which("dp-platform")
    if on_path and (not beside.exists() or Path(on_path).resolve() == beside.resolve()):
        return "dp-platform"
    if not beside.exists():
        return f"{sys.executable} -m pipelines.cli"
    rel = os.path.relpath(beside)
    return rel if not rel.startswith("..") else str(beside)


def ui_command(tracking_uri: str, experiment_id: str | None = None, run_id: str | None = None) -> str:
    """The command that opens the UI on this run's store, as this shell can type it; for a
    tracking server, which serves its own UI, the run's page there."""
    import shlex

    default = tracking.resolve_tracking_uri("sqlite:///mlflow.db")
    if tracking_uri.startswith(("http://", "https://")):
        base = tracking.redact(tracking_uri)
        return tracking.ui_link(base, experiment_id, run_id) if experiment_id else base
    ui = f"{cli_command()} ui"
    return ui if tracking_uri == default else f"{ui} --tracking-uri {shlex.quote(tracking_uri)}"


if __name__ == "__main__":
    sys.exit(main())
