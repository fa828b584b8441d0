"""The training job: single-process DP training on one dataset, with a privacy ledger.

    python -m pipelines.train                     # digits, ε=2, δ=1e-5, secure randomness
    python -m pipelines.train --target-epsilon 8 --epochs 40 --model cnn
    python -m pipelines.train --help

It validates the whole configuration and calibrates σ before any example is touched, then
trains with Poisson lots, per-example clipping and Gaussian noise (dpcore), and prints the
test accuracy and the ε spent, computed from the run's ledger.

The sharded Ray Train + MLflow pipeline replaces this body (issue B); the config and the
entrypoint stay.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import dpcore
from dpcore import accounting

from .data import DATASETS, load_dataset
from .models import MODELS, build_model

OPTIMIZERS = ("sgd", "adam", "nadam")


@dataclass(frozen=True)
class TrainConfig:
    dataset: str = field(default="digits", metadata={"help": f"dataset name ({', '.join(DATASETS)})"})
    model: str = field(default="mlp", metadata={"help": f"model ({', '.join(MODELS)})"})
    optimizer: str = field(default="adam", metadata={"help": f"optimizer applied to the noised gradient ({', '.join(OPTIMIZERS)})"})
    lr: float = field(default=0.02, metadata={"help": "learning rate"})
    momentum: float = field(default=0.9, metadata={"help": "momentum (sgd only)"})
    lot_size: int = field(default=512, metadata={"help": "expected lot size L; the Poisson rate is q = L/N"})
    physical_batch_size: int = field(default=256, metadata={"help": "examples per vmap call (memory, not privacy)"})
    epochs: float = field(default=60.0, metadata={"help": "passes over the data; steps = round(epochs/q)"})
    target_epsilon: float = field(default=2.0, metadata={"help": "privacy budget ε"})
    target_delta: float = field(default=1e-5, metadata={"help": "privacy budget δ (keep it well below 1/N)"})
    clip_norm: float = field(default=1.0, metadata={"help": "per-example L2 clipping bound C"})
    noise_multiplier: float | None = field(
        default=None, metadata={"help": "σ; default: calibrated to (ε, δ). If given, training stops at the budget"}
    )
    accountant: str = field(default="pld", metadata={"help": f"accountant ({', '.join(dpcore.ACCOUNTANTS)}); pld is tight"})
    seed: int | None = field(
        default=None,
        metadata={"help": "seed for noise and sampling: tests and research only. Default: secure mode (OS entropy, no seed)"},
    )
    init_seed: int = field(default=0, metadata={"help": "seed of the model's initial weights (public)"})
    quiet: bool = field(default=False, metadata={"help": "no progress output"})

    def validate(self) -> None:
        if self.dataset not in DATASETS:
            raise dpcore.DPConfigError(f"dataset={self.dataset!r} is unknown; available: {', '.join(DATASETS)}.")
        if self.model not in MODELS:
            raise dpcore.DPConfigError(f"model={self.model!r} is unknown; available: {', '.join(MODELS)}.")
        if self.optimizer not in OPTIMIZERS:
            raise dpcore.DPConfigError(f"optimizer={self.optimizer!r} is unknown; available: {', '.join(OPTIMIZERS)}.")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise dpcore.DPConfigError(f"lr={self.lr!r} is invalid: the learning rate must be a finite number > 0.")
        dpcore.validation.check_epsilon(self.target_epsilon)
        dpcore.validation.check_delta(self.target_delta)
        dpcore.validation.check_clip_norm(self.clip_norm)
        dpcore.validation.check_positive_int(self.lot_size, "lot_size")
        dpcore.validation.check_positive_int(self.physical_batch_size, "physical_batch_size")
        dpcore.accounting.check_accountant(self.accountant)


def make_optimizer(cfg: TrainConfig, params) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr)
    return torch.optim.NAdam(params, lr=cfg.lr)


@torch.no_grad()
def accuracy(model, split) -> float:
    model.eval()
    acc = (model(split.x).argmax(1) == split.y).float().mean().item()
    model.train()
    return acc


class Progress:
    """One line, rewritten in place: steps, ε spent, elapsed and ETA."""

    def __init__(self, total: int, enabled: bool, stream=sys.stderr):
        self.total, self.enabled, self.stream = total, enabled, stream
        self.start = time.monotonic()
        self.last = 0.0
        self.interactive = enabled and stream.isatty()

    def update(self, done: int, eps_fn) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < self.total and now - self.last < (1.0 if self.interactive else 5.0):
            return
        self.last = now
        elapsed = now - self.start
        eta = elapsed / done * (self.total - done) if done else float("nan")
        width = 24
        filled = int(width * done / self.total)
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] step {done}/{self.total}  "
            f"ε={eps_fn():.3f}  {elapsed:5.1f}s elapsed, ETA {eta:5.1f}s"
        )
        self.stream.write(("\r" + line) if self.interactive else (line + "\n"))
        if self.interactive and done == self.total:
            self.stream.write("\n")
        self.stream.flush()


def run(cfg: TrainConfig) -> dict:
    """Validate, plan, train, evaluate. Returns a summary dict. Raises before any training on
    bad input."""
    cfg.validate()
    data = load_dataset(cfg.dataset)
    n = len(data.train)
    torch.manual_seed(cfg.init_seed)  # public initialisation
    model = build_model(cfg.model, data.input_shape, data.num_classes)
    steps_planned = accounting.steps_for_epochs(cfg.epochs, dpcore.sample_rate_from_lot_size(cfg.lot_size, n))
    private = dpcore.make_private(
        model,
        make_optimizer(cfg, model.parameters()),
        F.cross_entropy,
        dataset_size=n,
        lot_size=cfg.lot_size,
        epochs=cfg.epochs,
        target_epsilon=cfg.target_epsilon,
        target_delta=cfg.target_delta,
        clip_norm=cfg.clip_norm,
        noise_multiplier=cfg.noise_multiplier,
        accountant=cfg.accountant,
        seed=cfg.seed,
        physical_batch_size=cfg.physical_batch_size,
        epsilon_every=max(1, steps_planned // 20),
    )
    x, y = data.train.x, data.train.y
    progress = Progress(private.steps, enabled=not cfg.quiet)
    t0 = time.monotonic()
    done = 0
    for lot in private.sampler:
        private.optimizer.accumulate(x[lot], y[lot])
        private.optimizer.step()
        done += 1
        progress.update(done, private.ledger.epsilon)
    seconds = time.monotonic() - t0
    return {
        "dataset": cfg.dataset,
        "train_examples": n,
        "test_accuracy": accuracy(model, data.test),
        "val_accuracy": accuracy(model, data.val),
        "epsilon": private.ledger.epsilon(),
        "delta": cfg.target_delta,
        "accountant": cfg.accountant,
        "noise_multiplier": private.noise_multiplier,
        "sample_rate": private.sample_rate,
        "steps": done,
        "randomness": private.randomness.describe(),
        "train_seconds": seconds,
        "ledger": private.ledger,
        "model": model,
    }


def _arg_type(f: dataclasses.Field):
    t = str(f.type)
    if "bool" in t:
        return None
    if "float" in t:
        return float
    if "int" in t:
        return int
    return str


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipelines.train",
        description="Train a model with example-level (ε, δ)-differential privacy (DP-SGD family) and print "
        "the test accuracy and the ε spent, computed from the run's privacy ledger.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if _arg_type(f) is None:
            p.add_argument(flag, action="store_true", help=f.metadata["help"])
        else:
            p.add_argument(flag, type=_arg_type(f), default=f.default, help=f.metadata["help"])
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = TrainConfig(**vars(args))
    try:
        with warnings.catch_warnings():
            if cfg.seed is not None:
                warnings.simplefilter("once", dpcore.SeededRandomnessWarning)
            out = run(cfg)
    except dpcore.DPError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"dataset={out['dataset']} (N_train={out['train_examples']})  steps={out['steps']}  "
        f"q={out['sample_rate']:.4f}  σ={out['noise_multiplier']:.4f}  randomness={out['randomness']}"
    )
    print(f"test accuracy: {out['test_accuracy']:.4f}")
    print(f"ε spent: {out['epsilon']:.4f} at δ={out['delta']:g} ({out['accountant']} accountant; example-level, add/remove, Poisson sampling)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
