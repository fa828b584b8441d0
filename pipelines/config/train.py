"""The training run's config: one frozen object, composed of sections. YAML files and CLI flags
only fill it in.

    cfg = load_config("run.yaml", overrides={"lr": 0.1})      # YAML (flat or by section), then flags
    cfg = TrainConfig(dataset="mnist", data_dir="~/data")      # or directly
    cfg.section(PrivacyConfig)                                 # one section, typed

The sections: data, model, privacy, method, audit, scale (how the work is spread and batched:
performance only, never the guarantee) and tracking. Each checks its own options; what crosses
sections is checked in :meth:`TrainConfig.validate` (the dataset, the model and the budget are
checked again, against the data, by the driver before any worker starts). Test hooks (fault
injection) are not options: they are handed to :func:`pipelines.train.run`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import dpcore

from ..catalog import MODELS, TEXT_DATASETS
from .options import (
    Composed,
    Section,
    check_choice,
    check_count,
    check_positive_number,
    check_seed,
    option,
)
from .scale import ScaleConfig
from .shared import AuditOptions, DatasetOptions, TrackingOptions, check_model

OPTIMIZERS = ("sgd", "adam", "nadam")


@dataclass(frozen=True)
class DataConfig(DatasetOptions):
    train_subset: int = option(
        0,
        "train on the first K examples of the publicly shuffled training split only (0: all); validation and test are unchanged",
    )

    def check(self) -> None:
        check_count(self, "train_subset")


@dataclass(frozen=True)
class ModelConfig(Section):
    """The network and the optimizer applied to the noised gradient."""

    SECTION = "model"

    model: str = option("mlp", f"model: {', '.join(MODELS)}")
    replace_batchnorm: bool = option(False, "replace BatchNorm layers by GroupNorm (needed for most tv: models)")
    activation: str | None = option(
        None,
        "activation of mlp, small_cnn, cnn, scatter_cnn: relu, tanh, elu, or tempered:s,T,o (Papernot et al.'s "
        "tempered sigmoid s·sigmoid(T·x)−o). Default: the model's own (relu; tanh for small_cnn and scatter_cnn)",
    )
    groupnorm: bool = option(False, "GroupNorm after each convolution of small_cnn and cnn")
    weight_standardization: bool = option(
        False, "weight-standardised convolutions in small_cnn and cnn (De et al. 2022)"
    )
    optimizer: str = option("adam", f"optimizer applied to the noised gradient: {', '.join(OPTIMIZERS)}")
    lr: float = option(0.02, "learning rate")
    head_lr: float | None = option(
        None,
        "hf: models: learning rate of the new classification head (default: lr); full fine-tuning under DP often needs "
        "a small lr for the pretrained weights and a large one for the head, which starts from random",
    )
    momentum: float = option(0.9, "momentum (sgd only)")
    init_seed: int = option(0, "seed of the model's initial weights (public, identical on every worker)")
    lora_rank: int = option(0, "hf: models: LoRA rank r (0: full fine-tuning); only the adapters and the head train")
    lora_alpha: float | None = option(None, "hf: models: LoRA scaling alpha (default 2r)")
    lora_targets: str = option(
        "query,value", "hf: models: comma-separated names of the Linear layers that get LoRA adapters"
    )
    pooling: str = option(
        "auto",
        "hf: models: how a text's token vectors become one for the head: cls (the model's own classifier, e.g. "
        "BERT's [CLS] pooler), mean (over the text's tokens), auto (what a sentence-transformers folder declares, "
        "else cls)",
    )

    def check(self) -> None:
        check_model(self)
        check_count(self, "lora_rank")
        if (self.lora_rank or self.lora_alpha is not None) and not self.model.startswith("hf:"):
            raise dpcore.DPConfigError(f"LoRA options apply to hf: models, not model={self.model!r}.")
        if self.lora_alpha is not None:
            check_positive_number(self, "lora_alpha")
        if self.lora_rank and not [t for t in self.lora_targets.split(",") if t.strip()]:
            raise dpcore.DPConfigError(
                "lora_targets is empty: name the Linear layers that get adapters (e.g. query,value)."
            )
        from ..text.hf import POOLINGS

        check_choice(self, "pooling", POOLINGS)
        if self.pooling != "auto" and not self.model.startswith("hf:"):
            raise dpcore.DPConfigError(f"pooling applies to hf: models, not model={self.model!r}.")
        check_choice(self, "optimizer", OPTIMIZERS)
        check_positive_number(self, "lr")
        if self.head_lr is not None:
            if not self.model.startswith("hf:"):
                raise dpcore.DPConfigError(f"head_lr applies to hf: models, not model={self.model!r}.")
            check_positive_number(self, "head_lr")
        if not (0 <= self.momentum < 1):
            raise dpcore.DPConfigError(f"momentum={self.momentum!r} is invalid: it must lie in [0, 1).")
        check_count(self, "init_seed")

    def lora(self):
        """The LoRA options of an hf: model (rank 0: full fine-tuning)."""
        from ..text.hf import LoraOptions

        targets = tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())
        return LoraOptions(self.lora_rank, self.lora_alpha, targets)


@dataclass(frozen=True)
class PrivacyConfig(Section):
    """The guarantee and the mechanism that gives it: budget, lots, clipping, noise, accountant."""

    SECTION = "privacy"

    lot_size: int = option(512, "expected lot size L; the Poisson rate is q = L/N")
    epochs: float = option(60.0, "passes over the data; steps = round(epochs/q)")
    target_epsilon: float = option(2.0, "privacy budget ε (example-level, add/remove)")
    target_delta: float = option(1e-5, "privacy budget δ (keep it well below 1/N)")
    clip_norm: float = option(1.0, "per-example clipping bound C (in the norm of --clip-norm-type)")
    noise_multiplier: float | None = option(
        None, "σ. Default: calibrated to (ε, δ) on the driver. If given, training stops when the budget is spent"
    )
    max_noise_multiplier: float = option(
        100.0, "refuse a plan whose calibrated σ exceeds this (the target ε is out of reach)"
    )
    accountant: str = option(
        "pld",
        "accountant: pld (tight; the default), rdp (Rényi DP, 8-20 percent looser), moments (Abadi et al.'s original moments accountant)",
    )
    noise: str = option(
        "gaussian",
        "noise: gaussian (DP-SGD), or laplace (the DP-Adam paper's form, made honest: needs --clip-norm-type l1, pld accountant)",
    )
    clip_norm_type: str = option("l2", "per-example clipping norm: l2, or l1 (for laplace noise)")
    seed: int | None = option(
        None, "seed for noise and sampling: tests and research only. Default: secure mode (OS entropy, no seed)"
    )

    def check(self) -> None:
        check_positive_number(self, "epochs", "max_noise_multiplier")
        dpcore.validation.check_epsilon(self.target_epsilon)
        dpcore.validation.check_delta(self.target_delta)
        dpcore.validation.check_clip_norm(self.clip_norm)
        if self.noise_multiplier is not None and not (
            isinstance(self.noise_multiplier, (int, float))
            and not isinstance(self.noise_multiplier, bool)
            and math.isfinite(self.noise_multiplier)
            and self.noise_multiplier > 0
        ):
            raise dpcore.DPConfigError(
                f"noise_multiplier={self.noise_multiplier!r} is invalid: σ must be a finite number > 0 (σ=0 would release "
                "gradients without privacy). Leave --noise-multiplier unset to calibrate σ from --target-epsilon."
            )
        dpcore.accountants.check_accountant(self.accountant)
        dpcore.validation.check_positive_int(self.lot_size, "lot_size")
        check_seed(self)


@dataclass(frozen=True)
class MethodConfig(Section):
    """What is done to each example's gradient and to the lot before the release: BAM, DP-SAT,
    augmentation multiplicity, EMA, DP-PCA (Knolle et al. 2023; Park et al. 2023; De et al.
    2022; Abadi et al. 2016). Whether a combination is valid is the method objects' decision
    (``dpcore.check_method_options``)."""

    SECTION = "method"

    method: str = option(
        "dpsgd", "dpsgd; bam (per-example ascent before clipping); dpsat (ascent along the previous private gradient)"
    )
    ascent: float | None = option(
        None, "ascent radius: λ for bam (default 0.02), ρ for dpsat (default 0.086); 0 is DP-SGD"
    )
    ascent_schedule: str = option("constant", "λ/ρ over the run: constant, warmup (linear from 0), cosine (down to 0)")
    ascent_warmup_fraction: float = option(0.1, "fraction of the steps the warmup schedule takes")
    bam_variant: str = option(
        "sam", "bam: sam (gradient at θ+λg_i/‖g_i‖) or exact (∇L_i + λH_i g_i/‖g_i‖, forward-over-reverse)"
    )
    augmentation_multiplicity: int = option(
        1, "K augmented copies per example (random crop with padding, flip), gradients averaged before clipping"
    )
    augment_padding: int = option(4, "random-crop padding in pixels (augmentation multiplicity)")
    augment_flip: bool = option(True, "random horizontal flips (augmentation multiplicity)")
    ema_decay: float | None = option(
        None, "parameter EMA decay (De et al.: 0.999); evaluation and the logged model use the average"
    )
    pca_components: int = option(0, "DP-PCA: project the inputs on k private principal directions (0: off; mlp only)")
    pca_noise_multiplier: float = option(8.0, "DP-PCA: σ of the symmetric noise on AᵀA (sensitivity 1)")
    pca_sample_rate: float = option(1.0, "DP-PCA: Poisson rate of the rows used (1: all)")

    def check(self) -> None:
        err = dpcore.DPConfigError
        if self.ascent is not None and (isinstance(self.ascent, bool) or not isinstance(self.ascent, (int, float))):
            raise err(f"ascent={self.ascent!r} has the wrong type: expected a number.")
        if self.ascent is not None and self.method == "dpsgd" and self.ascent != 0:
            raise err(
                f"ascent={self.ascent} has no effect with method='dpsgd'; set --method bam or dpsat, or drop --ascent."
            )
        if self.method != "bam" and self.bam_variant != "sam":
            raise err(f"bam_variant={self.bam_variant!r} has no effect with method={self.method!r}; set --method bam.")
        if self.method == "dpsgd" and self.ascent_schedule != "constant":
            raise err(
                f"ascent_schedule={self.ascent_schedule!r} has no effect with method='dpsgd'; set --method bam or dpsat."
            )
        check_choice(self, "ascent_schedule", dpcore.methods.ASCENT_SCHEDULES)
        if not (0 < self.ascent_warmup_fraction <= 1):
            raise err(f"ascent_warmup_fraction={self.ascent_warmup_fraction} must lie in (0, 1].")
        if (
            isinstance(self.augment_padding, bool)
            or not isinstance(self.augment_padding, int)
            or self.augment_padding < 0
        ):
            raise err(f"augment_padding={self.augment_padding!r} is invalid: it must be an integer ≥ 0.")
        if self.ema_decay is not None and not (0 <= self.ema_decay < 1):
            raise err(f"ema_decay={self.ema_decay} must lie in [0, 1) (De et al. use 0.999).")
        if isinstance(self.pca_components, bool) or not isinstance(self.pca_components, int) or self.pca_components < 0:
            raise err(
                f"pca_components={self.pca_components!r} is invalid: it is the number k ≥ 1 of principal directions "
                "kept by DP-PCA, or 0 for no projection."
            )
        if self.pca_components:
            dpcore.validation.check_noise_multiplier(self.pca_noise_multiplier, "pca_noise_multiplier")
            dpcore.validation.check_sample_rate(self.pca_sample_rate, "pca_sample_rate")

    def resolved_ascent(self) -> float:
        """λ or ρ: the given value, or the method's default from the papers (CIFAR-10 settings)."""
        if self.ascent is not None:
            return float(self.ascent)
        return {"bam": 0.02, "dpsat": 0.086}.get(self.method, 0.0)


@dataclass(frozen=True)
class AuditConfig(AuditOptions):
    audit_kind: str = option(
        "gradient",
        "gradient: white-box, each canary's gradient is C·e_j on a coordinate of its own (m ≤ parameters), scored by "
        "the released gradients; input: black-box, out-of-distribution images with random labels, scored by the "
        "final model's loss",
    )

    def check(self) -> None:
        if self.audit_canaries and self.audit_kind not in ("gradient", "input"):
            raise dpcore.DPConfigError(
                f"audit_kind={self.audit_kind!r} is unknown; use gradient (white-box) or input (black-box)."
            )


@dataclass(frozen=True)
class TrainTracking(TrackingOptions):
    diagnostics: bool = option(
        False,
        "NON-PRIVATE: also log training loss/accuracy and clip fractions; tags the run dp.diagnostics=non-private",
    )
    test_every_report: bool = option(
        True,
        "evaluate the test split at every report; --no-test-every-report: only at the end, so that nothing chosen "
        "during the run (pruning, early looks) can depend on it",
    )


# Sections are listed last-first: a dataclass orders inherited fields from the last base to the
# first, and flags, params and YAML keys keep the order data, model, privacy, ..., tracking.
@dataclass(frozen=True)
class TrainConfig(
    Composed, TrainTracking, ScaleConfig, AuditConfig, MethodConfig, PrivacyConfig, ModelConfig, DataConfig
):
    def validate(self) -> None:
        """Check every option that needs no data: each section's own checks, then what crosses
        sections. Raises DPConfigError naming the value and the fix."""
        self.check_sections()
        # the method objects decide what combines (one place)
        dpcore.check_method_options(**self.method_options(), clipping=self.clipping, accountant=self.accountant)
        text_data, text_model = self.dataset in TEXT_DATASETS, self.model.startswith("hf:")
        if text_data != text_model:
            raise dpcore.DPConfigError(
                f"dataset={self.dataset!r} and model={self.model!r} do not go together: text datasets "
                f"({', '.join(TEXT_DATASETS)}) need an hf: model, and hf: models need a text dataset."
            )
        if text_model and self.augmentation_multiplicity != 1:
            raise dpcore.DPConfigError("augmentation_multiplicity applies to images; a text run takes 1.")
        if self.pca_components and self.model != "mlp":
            raise dpcore.DPConfigError(
                f"pca_components={self.pca_components} projects the inputs to vectors, which only model='mlp' "
                f"takes (not {self.model!r})."
            )

    def method_options(self) -> dict:
        """The method's options as ``dpcore.check_method_options`` and ``DPOptimizer`` take them
        (λ/ρ resolved to its value; the worker turns it into the run's schedule)."""
        return {
            "method": self.method,
            "ascent": self.resolved_ascent(),
            "bam_variant": self.bam_variant,
            "noise": self.noise,
            "clip_norm_type": self.clip_norm_type,
            "augmentation_multiplicity": self.augmentation_multiplicity,
        }

    def prior_groups(self) -> list:
        """The run's releases before its steps, as ``dpcore.plan``'s ``prior_groups``: DP-PCA's, if on."""
        if not self.pca_components:
            return []
        return [(dpcore.pca.pca_event(self.pca_noise_multiplier, self.pca_sample_rate), 1)]

    def plan_options(self) -> dict:
        """``dpcore.plan``'s arguments but the dataset size and the run's other releases (:meth:`prior_groups`)."""
        return {
            "lot_size": self.lot_size,
            "epochs": self.epochs,
            "target_epsilon": self.target_epsilon,
            "target_delta": self.target_delta,
            "noise_multiplier": self.noise_multiplier,
            "accountant": self.accountant,
            "max_noise_multiplier": None if self.noise_multiplier is not None else self.max_noise_multiplier,
            "noise": self.noise,
        }
