"""The private optimizer step: a facade that wires the pieces of dpcore together.

:class:`DPOptimizer` wraps any ``torch.optim`` optimizer (SGD, Adam, NAdam, ...). One step:

1. :meth:`accumulate` (once or more per lot): per physical batch, the method's per-example
   vectors (:mod:`dpcore.methods`), each clipped to C and summed (:mod:`dpcore.clipping`, or
   book-keeping once checked against it, :mod:`dpcore.fastpath`). Memory is bounded by the
   physical batch size.
2. :meth:`step`: the release (:func:`dpcore.release.release`: check the budget → noise once →
   reduce across ranks → ÷ q·N → record in the ledger), then the wrapped optimizer's step on it.

The wrapped optimizer's state (momentum, Adam moments) only ever sees the noised gradient:
that is why DP-Adam has exactly DP-SGD's guarantee (post-processing).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from . import memory
from .clipping import per_sample_norms, warn_if_pieces_uncovered, warn_if_uncovered
from .diagnostics import LotDiagnostics
from .errors import DPConfigError
from .events import PoissonGaussian, PoissonLaplace
from .fastpath import CLIPPING_MODES, CheckedBookKeeping, choose_clipping
from .grad_sample import LossFn, PerSampleGradients
from .ledger import PrivacyLedger
from .lot import ClippedLot
from .methods import AscentArg, check_method_options, make_method
from .randomness import Randomness, SecureRandomness
from .release import ReduceFn, draw_noise, release
from .validation import (
    check_clip_norm,
    check_dataset_size,
    check_noise_multiplier,
    check_positive_int,
    check_sample_rate,
)

AugmentFn = Callable[[torch.Tensor], torch.Tensor]
# With a reduce_fn outside torch.distributed, the number of ranks is unknown: the bound on
# floating-point rounding (dpcore.clipping.float_sensitivity) assumes at most this many.
MAX_WORKERS = 4096
__all__ = ["CLIPPING_MODES", "DPOptimizer", "ReduceFn"]


class DPOptimizer:
    """Differentially private wrapper of a torch optimizer (see the module docstring).

    Args:
        optimizer: a ``torch.optim.Optimizer`` over (a superset of) the model's trainable params.
        model, loss_fn: the ``nn.Module`` and ``loss_fn(output, target)``.
        noise_multiplier, clip_norm: σ and C; the noise's std is σ·C (Laplace: scale b = σ·C).
        sample_rate, dataset_size: the sampler's Poisson rate q and N (all shards together).
        randomness: where the noise comes from (secure or seeded).
        ledger: the run's :class:`PrivacyLedger`; every release is checked and recorded there.
        physical_batch_size: the largest number of examples per per-example computation.
        add_noise, reduce_fn: in sharded training, only rank 0 adds noise, and ``reduce_fn``
            sums the tensors across ranks in place.
        clipping: ``"vmap"`` (default; any model), ``"bookkeeping"`` (Linear, Conv2d, WSConv2d,
            GroupNorm; faster; checked against vmap at the first batch) or ``"auto"``
            (book-keeping where it applies, else vmap). :attr:`clipping` says which is in use.
        method, ascent, bam_variant: ``"dpsgd"``, ``"bam"`` or ``"dpsat"``, with λ or ρ (a
            number or a schedule of the 0-based step) and BAM's variant (:mod:`dpcore.methods`).
        noise, clip_norm_type: ``"gaussian"`` with ``"l2"``, or ``"laplace"`` with ``"l1"``.
        augment, augmentation_multiplicity: ``x[B, ...] -> x[B, K, ...]``; each example's
            gradient is the mean over its K copies, clipped afterwards.
        diagnostics: NON-PRIVATE research mode (:mod:`dpcore.diagnostics`): per-step statistics
            in :attr:`diagnostics_history`; forces the vmap path and costs an extra all-reduce.
        autocast: ``"none"`` or ``"bf16"``: the model's forward under bf16 autocast; clipping
            stays in float32 or wider, the noise and every sum over examples in float64
            (:mod:`dpcore.precision`).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        model: nn.Module,
        loss_fn: LossFn,
        noise_multiplier: float,
        clip_norm: float,
        sample_rate: float,
        dataset_size: int,
        randomness: Randomness,
        ledger: PrivacyLedger,
        physical_batch_size: int = 256,
        add_noise: bool = True,
        reduce_fn: ReduceFn | None = None,
        clipping: str = "vmap",
        method: str = "dpsgd",
        ascent: AscentArg = 0.0,
        bam_variant: str = "sam",
        noise: str = "gaussian",
        clip_norm_type: str = "l2",
        augment: AugmentFn | None = None,
        augmentation_multiplicity: int = 1,
        diagnostics: bool = False,
        autocast: str = "none",
    ):
        opts = {
            "noise": noise,
            "clip_norm_type": clip_norm_type,
            "augmentation_multiplicity": augmentation_multiplicity,
        }
        check_method_options(method=method, ascent=ascent, bam_variant=bam_variant, clipping=clipping, **opts,
                             accountant=ledger.accountant)  # fmt: skip
        if (augment is None) != (augmentation_multiplicity == 1):
            raise DPConfigError(
                f"augmentation_multiplicity={augmentation_multiplicity} needs an augment function that returns that "
                "many copies per example (and augment needs multiplicity > 1)."
            )
        if not add_noise and reduce_fn is None:
            raise DPConfigError(
                "add_noise=False without a reduce_fn: this worker would step on its clipped sum with no "
                "noise at all. add_noise=False is only for ranks ≥ 1 of sharded training, whose sums are "
                "all-reduced (reduce_fn) with rank 0's noised sum before anyone steps."
            )
        self.optimizer, self.model, self.randomness, self.ledger = optimizer, model, randomness, ledger
        self.method = make_method(method, ascent, bam_variant)
        self.noise, self.clip_norm_type, self.norm_ord = noise, clip_norm_type, 1 if clip_norm_type == "l1" else 2
        self.augmentation_multiplicity = augmentation_multiplicity
        self.noise_multiplier = check_noise_multiplier(noise_multiplier)
        self.clip_norm = check_clip_norm(clip_norm)
        self.sample_rate = check_sample_rate(sample_rate)
        self.dataset_size = check_dataset_size(dataset_size)
        self.expected_lot_size = self.sample_rate * self.dataset_size
        self.add_noise, self.reduce_fn = add_noise, reduce_fn
        grad_sampler = PerSampleGradients(model, loss_fn, multiplicity=augmentation_multiplicity, autocast=autocast)
        mode = choose_clipping(clipping, model, method, augmentation_multiplicity, clip_norm_type, bool(diagnostics))
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [n for n, p in self.params.items() if id(p) not in held]
        if missing:
            raise ValueError(
                f"the optimizer does not hold these trainable parameters: {missing[:5]}; "
                "build it from model.parameters() or freeze them (requires_grad=False)."
            )
        event = PoissonLaplace if noise == "laplace" else PoissonGaussian
        self.event = event(self.noise_multiplier, self.sample_rate)
        self.lot = ClippedLot(
            self.params,
            clip_norm=self.clip_norm,
            norm_ord=self.norm_ord,
            method=self.method,
            grad_sampler=grad_sampler,
            physical_batch_size=check_positive_int(physical_batch_size, "physical_batch_size"),
            fast=CheckedBookKeeping(model, loss_fn, self.clip_norm, autocast=autocast)
            if mode == "bookkeeping"
            else None,
            diag=LotDiagnostics(self.params, self.clip_norm, self.norm_ord) if diagnostics else None,
            augment=augment,
            multiplicity=augmentation_multiplicity,
        )
        self.float_sensitivity = warn_if_uncovered(self.dataset_size, self.physical_batch_size, self.workers)
        self.steps_taken = self._nonfinite_total = 0
        self._prev_private: dict[str, torch.Tensor] | None = None  # the last released gradient

    # What the pieces know, under the names callers and tests use.
    clipping = property(lambda self: "bookkeeping" if self.lot.fast is not None and self.lot.fast.active else "vmap")
    _fast = property(lambda self: self.lot.fast)
    _fast_verified = property(lambda self: self.lot.fast is not None and self.lot.fast.verified)
    _sum = property(lambda self: self.lot.sums)
    augment = property(lambda self: self.lot.augment)
    diagnostics_enabled = property(lambda self: self.lot.diag is not None)
    diagnostics_history = property(lambda self: self.lot.diag.history if self.lot.diag is not None else [])
    shifts_applied = property(lambda self: self.method.shifts_applied)  # DP-SAT: lots evaluated shifted
    num_parameters = property(lambda self: sum(p.numel() for p in self.params.values()))

    @property
    def grad_sampler(self) -> PerSampleGradients:
        return self.lot.grad_sampler

    @grad_sampler.setter
    def grad_sampler(self, sampler) -> None:
        self.lot.grad_sampler = sampler

    @property
    def physical_batch_size(self) -> int:
        return self.lot.physical_batch_size

    @physical_batch_size.setter
    def physical_batch_size(self, size: int) -> None:
        self.lot.physical_batch_size = check_positive_int(size, "physical_batch_size")
        self.float_sensitivity = warn_if_uncovered(self.dataset_size, size, self.workers)

    @property
    def workers(self) -> int:
        """How many ranks' sums the release adds (for the bound on floating-point rounding):
        the process group's size where torch.distributed runs, else 1 without a ``reduce_fn``
        and, with one, at most ``MAX_WORKERS`` (an assumption the bound states)."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_world_size()
        return 1 if self.reduce_fn is None else MAX_WORKERS

    def current_ascent(self) -> float:
        """λ (BAM) or ρ (DP-SAT) for the lot being computed."""
        return self.method.ascent(self.steps_taken)

    def accumulate(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add the clipped per-example vectors of (x, y) to this lot's sum, in physical batches.
        Call it once or more per lot (also with an empty batch)."""
        self.lot.begin(self.steps_taken, self._prev_private)
        try:
            self.lot.add(x, y, self.steps_taken)
        except BaseException:  # never leave the weights shifted, nor a half-summed lot behind
            self._abort_lot()
            raise

    def step(self) -> None:
        """Release the lot's clipped sum (check → noise once → reduce → ÷ qN → record), then
        step the wrapped optimizer on it."""
        sums = [self.lot.sums[n] for n in self.params]
        warn_if_pieces_uncovered(self.dataset_size, self.physical_batch_size, self.workers, self.lot.batch_sums)
        diag = self.lot.diag
        try:
            clean = [s.clone() for s in sums] if diag is not None else None
            std, laplace = self.noise_multiplier * self.clip_norm, self.noise == "laplace"
            grads = release(
                sums,
                event=self.event,
                ledger=self.ledger,
                # drawn in the sums' float64: float32 noise lies on a grid 2⁻²³·σC apart, and the float64
                # sum's bits below it survived into the update, telling which neighbour it was (helper-33)
                noise=(lambda: draw_noise(self.randomness, sums, std, laplace)) if self.add_noise else None,
                reduce_fn=self.reduce_fn,
                expected_size=self.expected_lot_size,
                step=self.steps_taken + 1,
                clip_norm=self.clip_norm,
            )
            if clean is not None:
                diag.finish(clean, sums, self.reduce_fn, self._prev_private, self.steps_taken + 1)
        except BaseException:
            self._abort_lot()
            raise
        self.lot.restore()  # DP-SAT: back to θ exactly, before the update
        for p, g in zip(self.params.values(), grads):
            p.grad = g.to(p.dtype)  # the release is float64 (the lot's sums); the update, the parameters' dtype
        self.optimizer.step()
        if self.method.needs_previous_release or diag is not None:
            self._prev_private = {n: p.grad.detach().clone() for n, p in self.params.items()}
        self.steps_taken += 1
        self._nonfinite_total += self.lot.nonfinite
        self.lot.reset()

    def released_update(self) -> list[torch.Tensor]:
        """The update of the last release, as the wrapped optimizer applied it (noised, reduced,
        ÷ q·N): what the replay log keeps."""
        return [p.grad for p in self.params.values()]

    def replay(self, released: list[torch.Tensor], x: torch.Tensor | None = None) -> None:
        """Apply again, after a restart, a release that the replay log kept
        (:mod:`dpcore.ledger.replay`): the wrapped optimizer steps on exactly the released update,
        and the streams the original step drew from advance as they did then (the augmentations
        of ``x``, the lot's inputs; a seeded noise stream), so that the steps after it are the
        ones the run would have taken. Nothing is released, noised or recorded: the ledger holds
        that release already, once."""
        if self.lot.open:
            raise RuntimeError("replay is for a restored optimizer, between lots")
        if self.augment is not None and x is not None:
            for start in range(0, x.shape[0], self.physical_batch_size):
                self.lot.augmented(x[start : start + self.physical_batch_size])
        if self.add_noise and not isinstance(self.randomness, SecureRandomness):  # secure noise has no stream state
            like = [torch.empty(p.shape, dtype=torch.float64, device=p.device) for p in self.params.values()]
            draw_noise(
                self.randomness, like, self.noise_multiplier * self.clip_norm, self.noise == "laplace"
            )  # as step
        for p, g in zip(self.params.values(), released, strict=True):
            p.grad = g.to(device=p.device, dtype=p.dtype).view_as(p)
        self.optimizer.step()
        if self.method.needs_previous_release or self.lot.diag is not None:
            self._prev_private = {n: p.grad.detach().clone() for n, p in self.params.items()}
        self.steps_taken += 1

    def _abort_lot(self) -> None:
        self.lot.restore()
        self.lot.reset()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_coordinate_examples(self, coords: torch.Tensor, value: float) -> None:
        """White-box audit canaries (Steinke et al. 2023): one example per coordinate c of the
        flattened trainable parameters whose clipped gradient is ``value``·e_c, |value| ≤ C."""
        self.lot.begin(self.steps_taken, self._prev_private)
        self.lot.add_coordinates(coords, value)

    def fit_physical_batch_size(
        self, x: torch.Tensor, y: torch.Tensor, budget_bytes: int, at_least_one: bool = False
    ) -> dict:
        """The largest power-of-two physical batch size (at most the current one) whose
        measured peak memory fits ``budget_bytes``; see :func:`dpcore.memory.fit_optimizer`."""
        if self.lot.open:
            raise RuntimeError("fit_physical_batch_size is for before a lot starts")
        return memory.fit_optimizer(self, x, y, int(budget_bytes), at_least_one)

    def diagnostics(self, x: torch.Tensor | None = None, y: torch.Tensor | None = None) -> dict:
        """NON-PRIVATE: the count of examples skipped for a non-finite gradient so far, and with
        (x, y) their per-example gradient norms at the current parameters. Nothing here is
        noised or in the ledger."""
        out: dict = {"nonfinite_examples_skipped": self._nonfinite_total + self.lot.nonfinite}
        if x is not None:
            if self.augment is not None:  # leave the training augmentations' stream where it was
                saved = self.augment.state_dict() if hasattr(self.augment, "state_dict") else None
                x = self.lot.augmented(x)
                if saved is not None:
                    self.augment.load_state_dict(saved)
            out["per_sample_norms"] = per_sample_norms(self.grad_sampler(x, y), self.norm_ord)
        return out

    def state_dict(self) -> dict:
        """Wrapped optimizer state, steps taken, the noise stream's state (empty in secure mode),
        the last released gradient and the example shape the run took from its first batch (a
        resumed run keeps refusing another). The ledger and the sampler have state_dicts of
        their own."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "steps_taken": self.steps_taken,
            "randomness": self.randomness.state_dict(),
            "previous_private_gradient": self._prev_private,
            "example_shape": self.lot.example_shape,
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps_taken = int(state["steps_taken"])
        self.randomness.load_state_dict(state["randomness"])
        prev = state.get("previous_private_gradient")
        self._prev_private = None if prev is None else {n: t.clone() for n, t in prev.items()}
        shape = state.get("example_shape")  # absent from checkpoints written before it was kept
        if shape is not None:
            self.lot.example_shape = (tuple(shape[0]), tuple(shape[1]))
        self.lot.saved = None  # the model's weights come from the checkpoint, not from a lot in flight
        self.lot.reset()
