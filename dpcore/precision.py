"""Mixed precision of the model's forward: a performance flag, never the mechanism's arithmetic.

``autocast="bf16"`` runs the model's forward (and so its backward) under
``torch.autocast(device_type, dtype=torch.bfloat16)``, on CPU and on CUDA. What stays in float32
(or wider), whatever the forward did:

* the parameters, and the per-example gradients of the vmap path (autograd casts a gradient
  back to its parameter's dtype);
* book-keeping's inputs to its formulas: each layer's recorded input and output gradient are
  widened to the layer's parameter dtype before any norm or sum is formed, and the formulas run
  outside autocast (whose matmuls would otherwise be bf16);
* every clip factor, clipped sum (float64), noise draw, all-reduce and the division by qN: the clipping
  formulas run with autocast switched off (:func:`formulas`), also when the caller opened an
  autocast region around the step.

So each example's contribution still has norm ≤ C, computed from the very vector that is added:
bf16 changes how accurate each example's gradient is, not the sensitivity bound or the noise.
"""

from __future__ import annotations

import contextlib

import torch

from .errors import DPConfigError

AUTOCAST_MODES = ("none", "bf16")
LOW_PRECISION = (torch.bfloat16, torch.float16)


def check_autocast(mode: str) -> str:
    if mode not in AUTOCAST_MODES:
        raise DPConfigError(
            f"autocast={mode!r} is unknown; use one of {', '.join(AUTOCAST_MODES)} (bf16: the model's forward in "
            "bfloat16 under torch.autocast; clipping stays in float32 or wider, the noise and the sums in float64)."
        )
    return mode


def forward_autocast(mode: str, like: torch.Tensor):
    """The context the model's forward runs in: bf16 autocast on ``like``'s device, or nothing."""
    if mode != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(device_type=like.device.type, dtype=torch.bfloat16)


def formulas(like: torch.Tensor):
    """The context the clipping formulas run in: autocast off on ``like``'s device, whatever
    region the caller opened (under a bf16 autocast, a clip factor would be multiplied in bf16,
    and a share could exceed C by a few parts in 10⁴)."""
    return torch.autocast(device_type=like.device.type, enabled=False)


def widen(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bf16/fp16 activation or gradient as ``dtype`` (the layer's parameter dtype); anything
    else (token ids, float32, float64) as it is."""
    return t.to(dtype) if t.dtype in LOW_PRECISION and dtype not in LOW_PRECISION else t
