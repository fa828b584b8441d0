"""The lot being summed: per physical batch, the method's per-example vectors, each clipped to
C, added into one sum. Memory is bounded by the physical batch size, and physical batches never
change the sum (invariant: each example's contribution has norm ≤ C, whatever the method).

Which vectors are clipped is the method's (:mod:`dpcore.methods`: BAM's ascent-point
gradients, DP-SAT's shifted weights); how the clipped sum is computed is vmap
(:mod:`dpcore.clipping`) or book-keeping once checked against it (:mod:`dpcore.fastpath`).
Nothing here is released: :class:`dpcore.DPOptimizer` releases :attr:`ClippedLot.sums`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .clipping import clipped_sum
from .diagnostics import LotDiagnostics
from .errors import DPConfigError
from .fastpath import CheckedBookKeeping
from .methods import Method

Params = dict[str, torch.Tensor]


class ClippedLot:
    def __init__(
        self,
        params: Params,
        *,
        clip_norm: float,
        norm_ord: int,
        method: Method,
        grad_sampler,
        physical_batch_size: int,
        fast: CheckedBookKeeping | None = None,
        diag: LotDiagnostics | None = None,
        augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
        multiplicity: int = 1,
    ):
        self.params, self.clip_norm, self.norm_ord, self.method = params, clip_norm, norm_ord, method
        self.grad_sampler, self.physical_batch_size, self.fast, self.diag = (
            grad_sampler,
            physical_batch_size,
            fast,
            diag,
        )
        self.augment, self.multiplicity = augment, multiplicity
        # The lot's sums are float64 whatever the parameters' dtype. In float32, the rounding of
        # the running sum (its partial sums grow to L·C for a lot of L) depends on every example,
        # so removing one moved the sum by more than C: by up to 1.0012·C for L = 16,384 in
        # docs/benchmarks/float_sensitivity.py. In float64 that rounding is about 2⁻²⁹ of it. The
        # sums within each physical batch are float64 too (dpcore.clipping.weighted_sum).
        self.sums = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
        # batch_sums: how many sums were added into the lot's (each a rounding of every element,
        # which dpcore.clipping.float_sensitivity counts): counted on the host.
        self.examples = self.nonfinite = self.batch_sums = 0
        self.open = False
        self.saved: Params | None = None  # DP-SAT: θ while the weights are shifted
        # An example's shape (input, label) from the first batch on: it must not change (see _add).
        self.example_shape: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def begin(self, step: int, previous: Params | None) -> None:
        """Open the lot (once): the method may move the weights for it (DP-SAT)."""
        if not self.open:
            self.open = True
            self.saved = self.method.begin_lot(self.params, previous, step)

    def add(self, x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        """Add the clipped per-example vectors of (x, y), one physical batch at a time."""
        for start in range(0, x.shape[0], self.physical_batch_size):
            self._add(x[start : start + self.physical_batch_size], y[start : start + self.physical_batch_size], step)

    def _add(self, xb: torch.Tensor, yb: torch.Tensor, step: int) -> None:
        self._check_example_shape(xb, yb)
        xb = self.augmented(xb) if self.augment is not None else xb
        fast = self.fast is not None and self.fast.active
        # Every clip factor is taken at the configured physical batch size, never at the batch's
        # own (dpcore.clipping.rounding_floor): the last batch of a Poisson lot holds a number of
        # examples that depends on the data.
        size = self.physical_batch_size
        bad = self.fast.clipped_sum(xb, yb, self.sums, self.grad_sampler, size) if fast else None
        if bad is None:
            vectors = self.method.per_example(self.grad_sampler, xb, yb, step)
            per_sample, at_theta = vectors if vectors is not None else (self.grad_sampler(xb, yb), None)
            _, bad = clipped_sum(per_sample, self.clip_norm, out=self.sums, ord=self.norm_ord, batch_size=size)
            if self.diag is not None:  # the diagnostics are about the plain gradients at θ
                if at_theta is None:
                    at_theta = per_sample if self.saved is None else self.grad_sampler(xb, yb, params=self.saved)
                self.diag.accumulate(at_theta)
        self.nonfinite += bad
        self.examples += xb.shape[0]
        self.batch_sums += 1

    def _check_example_shape(self, xb: torch.Tensor, yb: torch.Tensor) -> None:
        """Refuse an example shape other than the first batch's. A shape that changes between
        batches means each example was shaped by its batch (a loader that pads a batch to its
        longest sequence): then one example's presence changes the others' inputs, and, on the
        book-keeping path, the layer forms (materialised or ghost, chosen by the positions per
        example) and so the rounding of every other example's share. Pad to a fixed length."""
        shape = (tuple(xb.shape[1:]), tuple(yb.shape[1:]))
        if self.example_shape is None:
            self.example_shape = shape
        elif shape != self.example_shape:
            # Neither shape is printed: with a loader that pads each batch, both depend on the data.
            which = " and ".join(w for w, a, b in zip(("input", "label"), shape, self.example_shape) if a != b)
            raise DPConfigError(
                f"an example's {which} shape changed from the run's first batch's. Under DP each example must be "
                "prepared on its own: a loader that pads each batch to its longest sequence lets one example change "
                "the others' inputs. Pad (or crop) every example to one fixed shape."
            )

    def augmented(self, xb: torch.Tensor) -> torch.Tensor:
        out, k = self.augment(xb), self.multiplicity
        if out.shape[:2] != (xb.shape[0], k):
            raise DPConfigError(
                f"augment returned shape {tuple(out.shape)}; it must return [batch, K={k}, ...] "
                f"for a batch of shape {tuple(xb.shape)}."
            )
        return out

    def add_coordinates(self, coords: torch.Tensor, value: float) -> None:
        """One example per coordinate c (of the flattened sums, in order) whose clipped vector
        is ``value``·e_c: white-box audit canaries. |value| ≤ C, checked here."""
        if not (abs(float(value)) <= self.clip_norm):
            raise DPConfigError(
                f"a canary gradient of norm {abs(float(value)):.6g} exceeds clip_norm={self.clip_norm}: it is not clipped."
            )
        total = sum(s.numel() for s in self.sums.values())
        coords = torch.as_tensor(coords, dtype=torch.long).flatten()
        if len(coords) and (int(coords.min()) < 0 or int(coords.max()) >= total):
            raise ValueError(f"canary coordinates must lie in [0, {total}).")
        start = 0
        for s in self.sums.values():
            mine = coords[(coords >= start) & (coords < start + s.numel())] - start
            flat = s.view(-1)
            ones = torch.full((len(mine),), float(value), dtype=flat.dtype, device=flat.device)
            flat.index_add_(0, mine.to(flat.device), ones)
            start += s.numel()
        self.examples += len(coords)
        self.batch_sums += 1

    def restore(self) -> None:
        """Put the weights back exactly where the lot found them (DP-SAT)."""
        self.method.end_lot(self.params, self.saved)
        self.saved = None

    def reset(self) -> None:
        if self.sums:
            torch._foreach_zero_(list(self.sums.values()))
        self.examples = self.nonfinite = self.batch_sums = 0
        self.open = False
        if self.diag is not None:
            self.diag.reset()
