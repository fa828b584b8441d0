"""``dp-platform sweep``: the command line of :mod:`tuning.sweep`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import dpcore
from dpcore.readout import epsilon_text
from pipelines.config.options import Parser

from .config import SWEEP_FIELDS, SweepConfig


def print_summary(s: dict) -> None:
    print(
        f"study {s['study']}: {s['complete']} complete of {s['trials']} trials (target {s['n_trials']}); MLflow parent "
        f"run {s['parent_run_id']}"
    )
    if s["selection_total_epsilon"] is not None:
        print(
            f"private selection: the sweep's total ε = {epsilon_text(s['selection_total_epsilon'], '.4f')} "
            f"at δ = {s['delta']:g} (best of a random number of trials, RDP)"
        )
    else:
        print("selection: the best trial was chosen on the validation split; that choice is not accounted in ε")
    if s.get("search_bound"):
        print(f"the search's cost to a training example: {s['search_bound']}")
    if s.get("stopped"):
        print(f"stopped early: {s['stopped']}")
    b = s["best"]
    if b is None:
        print("no complete trial")
        return
    if s["selection_total_epsilon"] is not None:  # only what the accounted total covers: the noisy score
        scores = f"noisy validation score {b['value']:.4f}"
    else:
        scores = f"validation {b['val_accuracy']:.4f}  test {b['test_accuracy']:.4f}"
    print(
        f"best trial {b['number']}: {b['params']}  {scores}  "
        f"ε={epsilon_text(b['epsilon'], '.4f')}  σ={b['noise_multiplier']:.4f}  run {b['run_id']}"
    )
    if b["registered_model"]:
        print(f"model: {b['registered_model']} in the MLflow registry")


# ------------------------------------------------------------------------------------------
def build_parser(prog: str = "dp-platform sweep") -> argparse.ArgumentParser:
    from pipelines.config import add_config_arguments

    p = Parser(
        prog=prog,
        description="Hyperparameter sweep at a fixed (ε, δ): every trial is a DP training run with σ calibrated for its own "
        "lot size and epochs; Optuna chooses, Ray runs, MLflow records (one parent run, a child run per trial).",
        epilog="The YAML file may hold sweep options (study, storage, n_trials, ...), a 'space:' mapping and any training option. "
        "Watch a study live with: optuna-dashboard sqlite:///optuna.db",
    )
    p.add_argument("config", nargs="?", help="YAML file")
    add_config_arguments(p, SweepConfig)
    add_config_arguments(p)
    return p


def check_args(argv: list[str]) -> None:
    """Parse and validate a sweep's arguments (config file, then flags), as ``dp-platform submit
    --sweep`` does before it uploads anything. Raises SystemExit on bad flags."""
    ns = vars(build_parser().parse_args(argv))
    load_sweep_config(ns.pop("config", None), ns)[1].validate()


def load_sweep_config(path: str | None, args: dict) -> tuple[SweepConfig, Any]:
    """(SweepConfig, base TrainConfig) from the YAML file and the flags (flags win)."""
    from pipelines.config import config_from_dict

    values: dict = {}
    if path is not None:
        import yaml

        p = Path(path)
        if not p.is_file():
            raise dpcore.DPConfigError(f"config file {str(p)!r} does not exist.")
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise dpcore.DPConfigError(f"config file {p} must hold a mapping.")
        values.update(loaded)
    values.update(args)
    sweep_vals = {k.replace("-", "_"): values.pop(k) for k in list(values) if k.replace("-", "_") in SWEEP_FIELDS}
    if "storage" not in sweep_vals and os.environ.get("DP_OPTUNA_STORAGE"):
        sweep_vals["storage"] = os.environ["DP_OPTUNA_STORAGE"]  # the cluster's shared study database
    if "num_workers" not in values:
        values["num_workers"] = 1  # a sweep's trials default to one worker each; --num-workers shards them
    return SweepConfig(**sweep_vals), config_from_dict(values)


def main(argv: list[str] | None = None, prog: str = "dp-platform sweep") -> int:
    args = vars(build_parser(prog).parse_args(argv))
    path = args.pop("config")
    try:
        sweep, base = load_sweep_config(path, args)
        import mlflow  # noqa: F401  (Optuna, Ray and MLflow: after the flags are parsed; imported before
        import optuna  # noqa: F401  their logging is routed, since importing them configures it)
        import ray  # noqa: F401

        from pipelines.logs import library_logs, log_path, meaning_warnings

        from .sweep import run_preset, run_sweep

        with library_logs(log_path(base.storage_path, "sweep"), keep=meaning_warnings()) as logs:
            if sweep.preset == "bam-appendix":
                out = run_preset(sweep, base)
            else:
                out = run_sweep(sweep, base)
    except dpcore.DPError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except TypeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if sweep.preset == "bam-appendix":
        for name, s in [("stage 1 (DP-SGD)", out["stage1"])] + [
            (f"stage 2 ({m})", s) for m, s in out["stage2"].items()
        ]:
            print(f"== {name}")
            print_summary(s)
        if out.get("search_epsilon_bound") is not None:
            print(
                f"the three stages together cost a training example at most ε ≤ {epsilon_text(out['search_epsilon_bound'], '.4g')} "
                "(RDP, data-independent: every stage-2 trial at the worst of the values stage 1 could have chosen)"
            )
    else:
        print_summary(out)
    logs.print_report("MLflow, Ray, Optuna", "; each trial's own output is in Ray's session logs")
    from pipelines.tracking import resolve_tracking_uri
    from pipelines.train.cli import ui_command

    print(f"open the UI: {ui_command(resolve_tracking_uri(base.tracking_uri))}")
    summaries = [out["stage1"], *out["stage2"].values()] if sweep.preset == "bam-appendix" else [out]
    return 1 if any(s.get("stopped") for s in summaries) else 0  # trials kept failing: not a finished sweep


if __name__ == "__main__":
    sys.exit(main())
