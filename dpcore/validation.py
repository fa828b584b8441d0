"""Checks at the boundary: privacy parameters, dataset sizes and models.

Every check raises before any noise is drawn or any budget is spent, and every message
names the bad value and the fix.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from .errors import DeltaTooLargeWarning, DPConfigError, UnsupportedModuleError


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _finite_positive(value, name: str, what: str) -> float:
    """``value`` as a float if it is a finite number > 0; else an error naming it and ``what``."""
    if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise DPConfigError(f"{name}={value!r} is invalid: {what}")
    return float(value)


def check_epsilon(epsilon, name: str = "target_epsilon") -> float:
    return _finite_positive(
        epsilon, name, f"ε must be a finite number > 0 (typical values are 0.5 to 10; for example {name}=2.0)."
    )


def check_delta(delta, name: str = "target_delta", dataset_size: int | None = None) -> float:
    if not _is_number(delta) or not (0.0 < delta < 1.0):
        raise DPConfigError(
            f"{name}={delta!r} is invalid: δ must lie strictly between 0 and 1; "
            f"use a value well below 1/N, for example {name}=1e-5."
        )
    if dataset_size is not None and dataset_size > 0 and delta >= 1.0 / dataset_size:
        warnings.warn(
            f"{name}={delta:g} is ≥ 1/N = 1/{dataset_size} = {1.0 / dataset_size:.3g}. "
            "A mechanism that publishes a random training example verbatim satisfies this δ, "
            f"so the guarantee is weak. Use {name} ≤ {0.1 / dataset_size:.1g} (at most 1/(10·N)).",
            DeltaTooLargeWarning,
            stacklevel=3,
        )
    return float(delta)


def check_sample_rate(sample_rate, name: str = "sample_rate") -> float:
    if not _is_number(sample_rate) or not (0.0 < sample_rate <= 1.0):
        raise DPConfigError(
            f"{name}={sample_rate!r} is invalid: the Poisson sample rate q must lie in (0, 1]. "
            "It is lot_size / dataset_size; for example lot_size=256 of 60,000 examples gives q≈0.0043."
        )
    return float(sample_rate)


# The smallest clipping bound accepted: the book-keeping norms of float64 models may miss terms
# that round to 0 in float64, below about 10⁻¹⁶² each (dpcore.bookkeeping.norms.balanced); for
# any C at or above this that is far inside the clipping margin.
MIN_CLIP_NORM = 1e-100


def check_clip_norm(clip_norm, name: str = "clip_norm") -> float:
    c = _finite_positive(
        clip_norm, name, f"the per-example L2 clipping bound C must be a finite number > 0 (for example {name}=1.0)."
    )
    if c < MIN_CLIP_NORM:
        raise DPConfigError(
            f"{name}={clip_norm!r} is invalid: the clipping bound C must be at least {MIN_CLIP_NORM:g} "
            f"(float64 rounds smaller norms' terms to 0); rescale the loss instead (for example {name}=1.0)."
        )
    return c


def check_noise_multiplier(noise_multiplier, name: str = "noise_multiplier") -> float:
    return _finite_positive(
        noise_multiplier,
        name,
        "the noise multiplier σ must be a finite number > 0. σ=0 releases gradients without privacy; to pick σ "
        "from a budget use dpcore.calibrate_noise_multiplier(target_epsilon, target_delta, sample_rate, steps).",
    )


def check_positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise DPConfigError(f"{name}={value!r} is invalid: it must be a positive integer.")
    return int(value)


def check_dataset_size(dataset_size, name: str = "dataset_size") -> int:
    if isinstance(dataset_size, bool) or not isinstance(dataset_size, int) or dataset_size <= 0:
        raise DPConfigError(
            f"{name}={dataset_size!r} is invalid: the dataset is empty or its size is unknown. "
            "Check the data source (path, split, filters) so that it yields at least one example."
        )
    return int(dataset_size)


def sample_rate_from_lot_size(lot_size, dataset_size) -> float:
    """q = L / N, with both checked. Raises if the lot is larger than the dataset."""
    dataset_size = check_dataset_size(dataset_size)
    lot_size = check_positive_int(lot_size, "lot_size")
    if lot_size > dataset_size:
        raise DPConfigError(
            f"lot_size={lot_size} is larger than the dataset (N={dataset_size}). The expected lot "
            f"size is q·N with q ≤ 1, so choose lot_size ≤ {dataset_size}."
        )
    return lot_size / dataset_size


# ---------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------

_MIXING_MODULES: tuple[type, ...] = (
    nn.modules.batchnorm._BatchNorm,  # BatchNorm1d/2d/3d, SyncBatchNorm, LazyBatchNorm*
)


def _mixing_reason(module: nn.Module) -> str | None:
    if isinstance(module, _MIXING_MODULES):
        return (
            "BatchNorm normalises each example with statistics of the whole batch, so one "
            "example's gradient depends on the others, and its running mean/variance are "
            "computed from private data without noise. Replace it with GroupNorm: "
            "model = dpcore.convert_batchnorm_to_groupnorm(model)"
        )
    if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
        return (
            "InstanceNorm with track_running_stats=True keeps running statistics computed from "
            "private data without noise. Construct it with track_running_stats=False, or use "
            "GroupNorm."
        )
    return None


def validate_model(model: nn.Module) -> None:
    """Reject models that mix examples or keep non-private statistics.

    Raises :class:`UnsupportedModuleError` naming every offending layer (by its
    qualified name) and the fix. Models with no trainable parameter are rejected too.
    """
    by_reason: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        reason = _mixing_reason(module)
        if reason is not None:
            by_reason.setdefault(reason, []).append(f"'{name or '<root>'}' ({type(module).__name__})")
    if by_reason:
        problems = []
        for reason, layers in by_reason.items():
            shown = ", ".join(layers[:8]) + (f" and {len(layers) - 8} more" if len(layers) > 8 else "")
            problems.append(f"  - layer{'s' if len(layers) > 1 else ''} {shown}: {reason}")
        raise UnsupportedModuleError(
            "The model cannot be trained with per-example differential privacy:\n" + "\n".join(problems)
        )
    low = sorted(
        {str(p.dtype) for p in model.parameters() if p.requires_grad and p.dtype not in (torch.float32, torch.float64)}
    )
    if low:
        raise UnsupportedModuleError(
            f"trainable parameters of dtype {', '.join(low)} are not supported: per-example clipping keeps "
            "‖g_i‖ ≤ C only up to the rounding of float32/float64 (half precision rounds by up to 0.4 %). "
            "Keep parameters in float32 (model.float()); autocast may still run the forward in lower precision."
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise UnsupportedModuleError(
            "The model has no trainable parameter (every parameter has requires_grad=False); "
            "there is nothing to train privately."
        )


def _group_count(num_channels: int, max_groups: int) -> int:
    for g in range(min(max_groups, num_channels), 0, -1):
        if num_channels % g == 0:
            return g
    return 1


def convert_batchnorm_to_groupnorm(model: nn.Module, max_groups: int = 32) -> nn.Module:
    """Replace every BatchNorm layer by a GroupNorm over the same channels, in place.

    The number of groups is the largest divisor of the channel count that is ≤ ``max_groups``
    (32 by default, as in Wu & He 2018). Affine parameters are kept when the BatchNorm had them.
    Returns the model (the same object, or the new module when the root itself is a BatchNorm).
    """

    def convert(module: nn.Module) -> nn.Module:
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            gn = nn.GroupNorm(
                _group_count(module.num_features, max_groups),
                module.num_features,
                eps=module.eps,
                affine=module.affine,
            )
            return gn
        for child_name, child in module.named_children():
            new = convert(child)
            if new is not child:
                setattr(module, child_name, new)
        return module

    return convert(model)
