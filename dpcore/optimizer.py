"""The private optimizer step.

:class:`DPOptimizer` wraps any ``torch.optim`` optimizer (SGD, Adam, NAdam, ...). One step:

1. :meth:`accumulate` (once or more per lot, one call per physical batch or a whole lot that
   it splits into physical batches): per-sample gradients (vmap), each clipped to C, summed
   into a buffer. Memory is bounded by the physical batch size.
2. :meth:`step`:
   a. ask the ledger whether this release fits in the budget (raises before anything is
      released);
   b. add N(0, σ²C²·I) to the clipped sum — once per lot, and only where ``add_noise`` is
      true (in sharded training, rank 0 only);
   c. ``reduce_fn`` (the all-reduce SUM across ranks; nothing in one process);
   d. divide by the *expected* lot size q·N (never by the realised count);
   e. write the result into ``param.grad`` and call the wrapped optimizer's ``step``;
   f. append the release to the ledger.

The wrapped optimizer's state (momentum, Adam moments) therefore only ever sees the noised
gradient: that is why DP-Adam has exactly DP-SGD's guarantee (post-processing).

The methods of :mod:`dpcore.methods` change only *which* per-example vector is clipped (BAM,
augmentation multiplicity) or *where* the lot's gradients are evaluated (DP-SAT), and the
noise's distribution (Gaussian or Laplace). Clipping, the one noise draw per lot, the all-reduce,
the division by qN and the ledger are the same code for all of them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from . import fastclip
from .clipping import clip_factors, clipped_sum, per_sample_norms
from .errors import DPConfigError
from .events import PoissonGaussian, PoissonLaplace, PrivacyEvent
from .grad_sample import LossFn, PerSampleGradients
from .ledger import PrivacyLedger
from .methods import AscentArg, as_schedule, bookkeeping_applies, check_method_options
from .randomness import Randomness
from .release import ReduceFn, draw_noise, release
from .validation import (
    check_clip_norm,
    check_dataset_size,
    check_noise_multiplier,
    check_positive_int,
    check_sample_rate,
)

AugmentFn = Callable[[torch.Tensor], torch.Tensor]
CLIPPING_MODES = ("vmap", "bookkeeping", "auto")


class DPOptimizer:
    """Differentially private wrapper of a torch optimizer (see module docstring).

    Args:
        optimizer: a ``torch.optim.Optimizer`` over (a superset of) the model's trainable params.
        model: the ``nn.Module``; validated (no BatchNorm, ...).
        loss_fn: ``loss_fn(output, target)`` for a batch of one example.
        noise_multiplier: σ. Noise std is σ·C.
        clip_norm: C.
        sample_rate: the Poisson rate q used by the sampler.
        dataset_size: N, the size of the whole dataset (all shards together).
        randomness: where the noise comes from (secure or seeded).
        ledger: the run's :class:`PrivacyLedger`; every step is checked and recorded there.
        physical_batch_size: the largest number of examples per vmap call.
        add_noise: False on every rank but one in sharded training.
        reduce_fn: called with the list of summed (noised) gradient tensors, in place.
        clipping: how the clipped sum is computed. ``"vmap"`` (default): per-example gradients
            with torch.func, for any model. ``"bookkeeping"``: :mod:`dpcore.fastclip` (Linear,
            Conv2d, WSConv2d and GroupNorm parameters only; faster). Book-keeping assumes that the model treats the
            examples of a batch independently along dim 0, which no cheap check can prove, so
            before it is trusted its clipped sum is compared with the vmap path's on the first
            physical batch of two or more examples; on any difference, or anything it cannot
            handle at run time, the optimizer warns and stays on the vmap path. ``"auto"``:
            book-keeping where it applies (supported layers; not BAM, augmentation
            multiplicity, L1 clipping or diagnostics), else vmap, silently; the platform's
            jobs use it by default. :attr:`clipping` says which was chosen.
        method: ``"dpsgd"`` (default), ``"bam"`` or ``"dpsat"`` (see :mod:`dpcore.methods`).
        ascent: BAM's λ or DP-SAT's ρ: a number, or a schedule ``step -> value`` (0-based step).
        bam_variant: ``"sam"`` (gradient at the per-example ascent point) or ``"exact"``
            (∇L_i + λ·H_i g_i/‖g_i‖ by forward-over-reverse).
        noise: ``"gaussian"`` (default) or ``"laplace"`` (needs ``clip_norm_type="l1"``; then
            ``noise_multiplier`` is b/C, the Laplace scale over the L1 bound).
        clip_norm_type: ``"l2"`` (default) or ``"l1"``.
        augment: ``x[B, ...] -> x[B, K, ...]``, K augmented copies of each example, applied to
            every physical batch; with it, each example's gradient is the mean over its copies,
            clipped afterwards (so its contribution is still ≤ C).
        augmentation_multiplicity: K (must match what ``augment`` returns).
        diagnostics: NON-PRIVATE research mode. Each step also records, in
            :attr:`diagnostics_history` (all lot means over the realised count l, not qN):
            ``bias`` = ‖ĝ_clip − ĝ‖, the bias of DP-SGD's clipped mean at θ (BAM Fig. 2; the
            plain per-example gradients at θ for every method, so methods compare on the same
            quantity); ``magnitude_error_a`` = ⟨s/l, ĝ⟩/‖ĝ‖² with s the method's clipped sum
            before noise — for DP-SGD exactly Appendix C's (1/l)Σ η_i/M_i, for BAM/DP-SAT the
            same projection of their clipped vectors; ``direction_error_c`` = ‖(s + noise)/l − aĝ‖
            and ``direction_error_c_clip`` = ‖s/l − aĝ‖ (without the noise); and the cosines
            with ĝ of the per-example ascent directions g_i/‖g_i‖ (mean over i; BAM's) and of
            the previous released gradient (DP-SAT's), BAM Fig. 4. Costs extra passes and an
            extra all-reduce per step. Forces the vmap path.
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
    ):
        check_method_options(
            method=method,
            ascent=ascent,
            bam_variant=bam_variant,
            noise=noise,
            clip_norm_type=clip_norm_type,
            augmentation_multiplicity=augmentation_multiplicity,
            clipping=clipping,
            accountant=ledger.accountant,
        )
        if (augment is None) != (augmentation_multiplicity == 1):
            raise DPConfigError(
                f"augmentation_multiplicity={augmentation_multiplicity} needs an augment function that returns that many "
                "copies per example (and augment needs multiplicity > 1)."
            )
        self.method, self.bam_variant, self.noise = method, bam_variant, noise
        self.schedule = as_schedule(ascent)
        self.norm_ord = 1 if clip_norm_type == "l1" else 2
        self.clip_norm_type = clip_norm_type
        self.augment = augment
        self.augmentation_multiplicity = augmentation_multiplicity
        self.diagnostics_enabled = bool(diagnostics)
        if clipping == "auto":
            fits = (
                bookkeeping_applies(method, augmentation_multiplicity, clip_norm_type) and not self.diagnostics_enabled
            )
            clipping = "bookkeeping" if fits and fastclip.supports(model) else "vmap"
        if self.diagnostics_enabled and clipping == "bookkeeping":
            warnings.warn("diagnostics need per-example gradients: using the vmap path.", stacklevel=2)
            clipping = "vmap"
        self.optimizer = optimizer
        self.model = model
        self.noise_multiplier = check_noise_multiplier(noise_multiplier)
        self.clip_norm = check_clip_norm(clip_norm)
        self.sample_rate = check_sample_rate(sample_rate)
        self.dataset_size = check_dataset_size(dataset_size)
        self.expected_lot_size = self.sample_rate * self.dataset_size
        self.physical_batch_size = check_positive_int(physical_batch_size, "physical_batch_size")
        self.randomness = randomness
        self.ledger = ledger
        if not add_noise and reduce_fn is None:
            raise DPConfigError(
                "add_noise=False without a reduce_fn: this worker would step on its clipped sum with no "
                "noise at all. add_noise=False is only for ranks ≥ 1 of sharded training, whose sums are "
                "all-reduced (reduce_fn) with rank 0's noised sum before anyone steps."
            )
        self.add_noise = add_noise
        self.reduce_fn = reduce_fn
        self.grad_sampler = PerSampleGradients(model, loss_fn, multiplicity=augmentation_multiplicity)
        if clipping not in CLIPPING_MODES:
            raise DPConfigError(f"clipping={clipping!r} is unknown; use one of {', '.join(CLIPPING_MODES)}.")
        self._fast = None
        self._fast_verified = False
        if clipping == "bookkeeping":
            if not fastclip.supports(model):
                raise DPConfigError(
                    "clipping='bookkeeping' handles Linear, Conv2d, WSConv2d and GroupNorm parameters only; these are not: "
                    f"{fastclip.unsupported_parameters(model)[:5]}. Use clipping='vmap'."
                )
            self._fast = fastclip.BookKeepingClipper(model, loss_fn)
        self.clipping = "bookkeeping" if self._fast is not None else "vmap"
        self.params = dict((n, p) for n, p in model.named_parameters() if p.requires_grad)
        opt_params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [n for n, p in self.params.items() if id(p) not in opt_params]
        if missing:
            raise ValueError(
                f"the optimizer does not hold these trainable parameters: {missing[:5]}; "
                "build it from model.parameters() or freeze them (requires_grad=False)."
            )
        if noise == "laplace":
            self.event: PrivacyEvent = PoissonLaplace(self.noise_multiplier, self.sample_rate)
        else:
            self.event = PoissonGaussian(self.noise_multiplier, self.sample_rate)
        self.steps_taken = 0
        self._sum = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self._examples_in_lot = 0
        self._nonfinite_in_lot = 0
        self._nonfinite_total = 0
        self._lot_open = False
        self._unshifted: dict[str, torch.Tensor] | None = None  # DP-SAT: θ while the weights are shifted
        self.shifts_applied = 0  # DP-SAT: number of lots evaluated at a shifted point
        self._prev_private: dict[str, torch.Tensor] | None = None  # the last released gradient (DP-SAT, diagnostics)
        self._diag: dict[str, torch.Tensor] | None = None
        self.diagnostics_history: list[dict] = []

    # ----------------------------------------------------------------------------------
    def accumulate(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add the clipped per-example gradients of (x, y) to this lot's sum.

        ``x`` may be larger than a physical batch; it is processed in chunks of
        ``physical_batch_size``. Call it once or more per lot (also with an empty batch).
        """
        if not self._lot_open:
            self._begin_lot()
        try:
            self._accumulate(x, y)
        except BaseException:
            # Never leave the weights at DP-SAT's ascent point, nor a half-summed lot behind.
            self._remove_shift()
            self._reset_lot()
            raise

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.params.values())

    def add_coordinate_examples(self, coords: torch.Tensor, value: float) -> None:
        """Add k examples whose clipped gradient is ``value``·e_c for each c in ``coords``
        (coordinates of the flattened trainable parameters, in order) to this lot's sum:
        white-box audit canaries (Steinke et al. 2023), whose gradient *is* a chosen
        direction. |value| ≤ clip_norm, so each has the sensitivity of any other example (in
        L2 and in L1) and the privacy analysis is unchanged; a larger value is refused."""
        if not (abs(float(value)) <= self.clip_norm):
            raise DPConfigError(
                f"a canary gradient of norm {abs(float(value)):.6g} exceeds clip_norm={self.clip_norm}: it is not clipped."
            )
        coords = torch.as_tensor(coords, dtype=torch.long).flatten()
        if len(coords) and (int(coords.min()) < 0 or int(coords.max()) >= self.num_parameters):
            raise ValueError(f"canary coordinates must lie in [0, {self.num_parameters}).")
        if not self._lot_open:
            self._begin_lot()
        i = 0
        for name, p in self.params.items():
            mine = coords[(coords >= i) & (coords < i + p.numel())] - i
            if len(mine):
                flat = self._sum[name].view(-1)
                flat.index_add_(
                    0,
                    mine.to(flat.device),
                    torch.full((len(mine),), float(value), dtype=flat.dtype, device=flat.device),
                )
            i += p.numel()
        self._examples_in_lot += len(coords)

    def _accumulate(self, x: torch.Tensor, y: torch.Tensor) -> None:
        n = x.shape[0]
        for start in range(0, n, self.physical_batch_size):
            xb = x[start : start + self.physical_batch_size]
            yb = y[start : start + self.physical_batch_size]
            if self.augment is not None:
                xb = self._augmented(xb)
            bad = None
            if self._fast is not None:
                try:
                    if self._fast_verified:
                        bad = self._fast.clipped_sum(xb, yb, self.clip_norm, self._sum)
                    elif xb.shape[0] >= 2:
                        bad = self._verify_fast(xb, yb)
                except fastclip.Unsupported as e:  # raised before anything is added
                    self._leave_fast(str(e))
            if bad is None:
                per_sample, at_theta = self._per_example(xb, yb)
                _, bad = clipped_sum(per_sample, self.clip_norm, out=self._sum, ord=self.norm_ord)
                if self.diagnostics_enabled:
                    self._diag_accumulate(at_theta)
            self._nonfinite_in_lot += bad
            self._examples_in_lot += xb.shape[0]

    def _augmented(self, xb: torch.Tensor) -> torch.Tensor:
        out = self.augment(xb)
        k = self.augmentation_multiplicity
        if out.shape[:2] != (xb.shape[0], k):
            raise DPConfigError(
                f"augment returned shape {tuple(out.shape)}; it must return [batch, K={k}, ...] "
                f"for a batch of shape {tuple(xb.shape)}."
            )
        return out

    def current_ascent(self) -> float:
        """λ (BAM) or ρ (DP-SAT) for the lot being computed."""
        value = float(self.schedule(self.steps_taken))
        if not (value >= 0 and value < float("inf")):
            raise DPConfigError(
                f"the ascent schedule gave {value!r} at step {self.steps_taken}; it must be a finite number ≥ 0."
            )
        return value

    def _per_example(self, xb: torch.Tensor, yb: torch.Tensor):
        """(the per-example vectors to clip, the plain per-example gradients at θ or None)."""
        if self.method == "bam":
            lam = self.current_ascent()
            if lam > 0:
                return self.grad_sampler.bam(xb, yb, lam, self.bam_variant)
        per_sample = self.grad_sampler(xb, yb)
        if not self.diagnostics_enabled:
            return per_sample, None
        if self._unshifted is not None:  # DP-SAT: the diagnostics are about θ, not the ascent point
            return per_sample, self.grad_sampler(xb, yb, params=self._unshifted)
        return per_sample, per_sample

    def _begin_lot(self) -> None:
        """DP-SAT: move the weights once, for the whole lot, along the last released gradient."""
        self._lot_open = True
        if self.method != "dpsat" or self._prev_private is None:
            return
        rho = self.current_ascent()
        if rho == 0:
            return
        sq = sum(float(g.double().square().sum()) for g in self._prev_private.values())
        if not (sq > 0 and sq < float("inf")):
            return
        scale = rho / sq**0.5
        with torch.no_grad():
            self._unshifted = {n: p.detach().clone() for n, p in self.params.items()}
            for n, p in self.params.items():
                p.add_(self._prev_private[n], alpha=scale)
        self.shifts_applied += 1

    def _remove_shift(self) -> None:
        if self._unshifted is None:
            return
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self._unshifted[n])
        self._unshifted = None

    def _leave_fast(self, why: str) -> None:
        warnings.warn(
            f"book-keeping clipping cannot be used for this model ({why}); using the vmap path.", stacklevel=3
        )
        self._fast, self.clipping = None, "vmap"

    def _verify_fast(self, xb: torch.Tensor, yb: torch.Tensor) -> int | None:
        """First use of book-keeping: compute the batch both ways and keep book-keeping only if
        the clipped sums agree (to 1e-5 relative to the sum's scale). Adds the reference sum
        either way. Returns the reference's non-finite count."""
        fast: dict[str, torch.Tensor] = {}
        fast_bad = self._fast.clipped_sum(xb, yb, self.clip_norm, fast)
        ref, bad = clipped_sum(self.grad_sampler(xb, yb), self.clip_norm)
        agree = self._sums_agree(fast, fast_bad, ref, bad)
        if not agree and any(p.dtype != torch.float64 for p in self.params.values()):
            # A deep float32 model's own rounding (GroupNorm, weight standardisation) can part
            # the two paths by more than 1e-5 while both are equally far from the exact
            # values: then the two formulas are compared on a float64 copy of the model, and
            # the float32 fast sum must be no further from that float64 reference than twice
            # the float32 reference's own distance (plus the 1e-5 tolerance).
            ref64 = self._agree_in_float64(xb, yb)
            agree = ref64 is not None and fast_bad == bad and set(fast) == set(ref)
            if agree:
                scale = max(float(v.abs().max()) for v in ref64.values()) if ref64 else 0.0
                slack = 1e-5 * max(scale, self.clip_norm)
                for k, r64 in ref64.items():
                    own = float((ref[k].double() - r64).abs().max())
                    agree = agree and float((fast[k].double() - r64).abs().max()) <= 2.0 * own + slack
        for k, v in ref.items():
            self._sum[k].add_(v)
        if agree:
            self._fast_verified = True
        else:
            self._leave_fast("its clipped sum differs from the per-example (vmap) reference on this model")
        return bad

    def fit_physical_batch_size(self, x: torch.Tensor, y: torch.Tensor, budget_bytes: int) -> dict:
        """Set ``physical_batch_size`` to the largest power of two (at most the current value)
        whose measured peak memory fits ``budget_bytes`` (:mod:`dpcore.memory`). Probes run
        this optimizer's own per-example path (BAM's ascent, DP-SAT's diagnostics pair, and,
        before book-keeping is verified, both book-keeping and vmap) on batches shaped like
        ``x``; their sums are thrown away,
        nothing is released, sampled or ledgered, and the augmentation stream is put back.
        Only the shapes and dtypes of ``x`` and ``y`` are used: the probes run on random inputs
        and zero targets of those shapes, so the measured sizes (which the pipeline logs)
        are not a statistic of the training data. Returns the measurement report."""
        from . import memory

        if self._lot_open:
            raise RuntimeError("fit_physical_batch_size is for before a lot starts")
        upper = self.physical_batch_size
        if len(x) == 0:
            return {"physical_batch_size": upper, "measured": False, "reason": "no examples to probe with"}
        need = min(upper, max(memory.PROBE_BATCHES))
        g = torch.Generator().manual_seed(0)
        shape = (need, *x.shape[1:])
        if x.is_floating_point():
            x = torch.randn(shape, generator=g, dtype=x.dtype).to(x.device)
        else:
            x = torch.zeros(shape, dtype=x.dtype, device=x.device)
        y = torch.zeros((need, *y.shape[1:]), dtype=y.dtype, device=y.device)

        def probe(b: int):
            xb, yb = x[:b], y[:b]
            if self.augment is not None:
                xb = self._augmented(xb)
            if self._fast is not None:
                try:
                    self._fast.clipped_sum(xb, yb, self.clip_norm, {})
                except fastclip.Unsupported:
                    pass
            if self._fast is None or not self._fast_verified:
                alive = []  # per-example sets that training holds at the same time
                if self.method == "bam":  # the ascent's memory, whatever λ is at step 0
                    per_sample, at_theta = self.grad_sampler.bam(xb, yb, 1.0, self.bam_variant)
                    alive.append(at_theta)
                else:
                    per_sample = self.grad_sampler(xb, yb)
                    if self.method == "dpsat" and self.diagnostics_enabled:  # a second set, at θ
                        alive.append(self.grad_sampler(xb, yb))
                clipped_sum(per_sample, self.clip_norm, ord=self.norm_ord)
                alive.clear()

        saved = self.augment.state_dict() if self.augment is not None and hasattr(self.augment, "state_dict") else None
        try:
            device = next(iter(self.params.values())).device
            report = memory.fit_batch_size(probe, upper, int(budget_bytes), device)
        finally:
            if saved is not None:
                self.augment.load_state_dict(saved)
        if report["physical_batch_size"] < upper:
            self.physical_batch_size = report["physical_batch_size"]
        report["physical_batch_size"] = self.physical_batch_size
        return report

    def _sums_agree(self, fast: dict, fast_bad: int, ref: dict, bad: int) -> bool:
        scale = max(float(v.abs().max()) for v in ref.values()) if ref else 0.0
        return (
            fast_bad == bad
            and set(fast) == set(ref)
            and all(
                torch.allclose(fast[k].to(ref[k].dtype), ref[k], rtol=0.0, atol=1e-5 * max(scale, self.clip_norm))
                for k in ref
            )
        )

    def _agree_in_float64(self, xb: torch.Tensor, yb: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The reference clipped sum on a float64 copy of the model if book-keeping agrees
        with it there (to 1e-5 of its scale), else None."""
        import copy

        try:
            model64 = copy.deepcopy(self.model).double()
            x64 = xb.double() if xb.is_floating_point() else xb
            fast: dict[str, torch.Tensor] = {}
            fast_bad = fastclip.BookKeepingClipper(model64, self._fast.loss_fn).clipped_sum(
                x64, yb, self.clip_norm, fast
            )
            sampler = PerSampleGradients(model64, self._fast.loss_fn, multiplicity=self.augmentation_multiplicity)
            ref, bad = clipped_sum(sampler(x64, yb), self.clip_norm)
        except Exception:  # a model that cannot be copied or run in float64: not verified
            return None
        return ref if self._sums_agree(fast, fast_bad, ref, bad) else None

    def step(self) -> None:
        """Release the lot's clipped sum (:func:`dpcore.release.release`: check → noise once →
        reduce → ÷ qN → record), then step the wrapped optimizer on it."""
        sums = [self._sum[n] for n in self.params]
        try:
            clean = [s.clone() for s in sums] if self.diagnostics_enabled else None
            std, laplace = self.noise_multiplier * self.clip_norm, self.noise == "laplace"
            grads = release(
                sums,
                event=self.event,
                ledger=self.ledger,
                noise=(lambda: draw_noise(self.randomness, sums, std, laplace)) if self.add_noise else None,
                reduce_fn=self.reduce_fn,
                expected_size=self.expected_lot_size,
                step=self.steps_taken + 1,
                clip_norm=self.clip_norm,
            )
            if clean is not None:
                self._diag_finish(clean)
        except BaseException:
            self._remove_shift()
            self._reset_lot()
            raise
        self._remove_shift()  # DP-SAT: back to θ exactly, before the update
        for p, g in zip(self.params.values(), grads):
            p.grad = g
        self.optimizer.step()
        if self.method == "dpsat" or self.diagnostics_enabled:
            self._prev_private = {n: p.grad.detach().clone() for n, p in self.params.items()}
        self.steps_taken += 1
        self._nonfinite_total += self._nonfinite_in_lot
        self._reset_lot()

    def _reset_lot(self) -> None:
        for s in self._sum.values():
            s.zero_()
        self._examples_in_lot = 0
        self._nonfinite_in_lot = 0
        self._lot_open = False
        self._diag = None

    # ----------------------------------------------------------------------------------
    # Diagnostics (NON-PRIVATE research mode; see the class docstring).
    def _diag_accumulate(self, g: dict[str, torch.Tensor]) -> None:
        if self._diag is None:
            device = next(iter(self.params.values())).device
            self._diag = {"count": torch.zeros((), dtype=torch.float64, device=device)}
            for key in ("sum", "clipped", "unit"):
                self._diag.update({f"{key}:{n}": torch.zeros_like(p) for n, p in self.params.items()})
        norms = per_sample_norms(g)
        factors, finite = clip_factors(norms if self.norm_ord == 2 else per_sample_norms(g, 1), self.clip_norm)
        finite = finite & torch.isfinite(norms)
        unit = torch.where(finite & (norms > 0), 1.0 / norms.clamp_min(1e-300), torch.zeros_like(norms))
        for n in self.params:
            gi = torch.where(finite.view(-1, *([1] * (g[n].dim() - 1))), g[n], torch.zeros((), dtype=g[n].dtype))
            self._diag[f"sum:{n}"].add_(gi.sum(0))
            self._diag[f"clipped:{n}"].add_(torch.einsum("i,i...->...", factors.to(gi.dtype), gi))
            self._diag[f"unit:{n}"].add_(torch.einsum("i,i...->...", unit.to(gi.dtype), gi))
        self._diag["count"] += float(finite.sum())

    def _diag_finish(self, clean: list[torch.Tensor]) -> None:
        if self._diag is None:  # no example on this rank: contribute zeros to the reduction
            self._diag_accumulate(
                {n: torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device) for n, p in self.params.items()}
            )
        names = list(self.params)
        tensors = [self._diag[f"{k}:{n}"] for k in ("sum", "clipped", "unit") for n in names] + clean
        count = self._diag["count"].to(self._sum[names[0]].dtype).reshape(1)
        if self.reduce_fn is not None:
            self.reduce_fn(tensors + [count])
        l = float(count)  # noqa: E741 (the lot size l of the BAM paper)
        flat = lambda ts: torch.cat([t.reshape(-1).double() for t in ts])  # noqa: E731
        k = len(names)
        g_hat = flat(tensors[:k]) / max(l, 1.0)
        g_clip = flat(tensors[k : 2 * k]) / max(l, 1.0)
        unit_sum = flat(tensors[2 * k : 3 * k])
        method_clip = flat(tensors[3 * k :]) / max(l, 1.0)
        released = flat([self._sum[n] for n in names]) / max(l, 1.0)
        gn = float(g_hat.norm())
        a = float(method_clip @ g_hat) / gn**2 if gn > 0 else float("nan")
        rec = {
            "step": self.steps_taken + 1,
            "examples": l,
            "grad_norm": gn,
            "bias": float((g_clip - g_hat).norm()),
            "magnitude_error_a": a,
            "direction_error_c": float((released - a * g_hat).norm()) if gn > 0 else float("nan"),
            "direction_error_c_clip": float((method_clip - a * g_hat).norm()) if gn > 0 else float("nan"),
            "cos_per_example_ascent": float(unit_sum @ g_hat) / (max(l, 1.0) * gn) if gn > 0 else float("nan"),
            "cos_previous_private": float("nan"),
        }
        if self._prev_private is not None and gn > 0:
            prev = flat([self._prev_private[n] for n in names])
            pn = float(prev.norm())
            if pn > 0:
                rec["cos_previous_private"] = float(prev @ g_hat) / (pn * gn)
        self.diagnostics_history.append(rec)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # ----------------------------------------------------------------------------------
    def diagnostics(self, x: torch.Tensor | None = None, y: torch.Tensor | None = None) -> dict:
        """NON-PRIVATE statistics, for an explicit diagnostics mode only.

        Returns the count of examples skipped for a non-finite gradient so far, and, when
        (x, y) are given, their per-example gradient norms at the current parameters.
        Nothing here is noised or in the ledger.
        """
        out: dict = {"nonfinite_examples_skipped": self._nonfinite_total + self._nonfinite_in_lot}
        if x is not None:
            if self.augment is not None:  # leave the training augmentations' stream where it was
                saved = self.augment.state_dict() if hasattr(self.augment, "state_dict") else None
                x = self._augmented(x)
                if saved is not None:
                    self.augment.load_state_dict(saved)
            out["per_sample_norms"] = per_sample_norms(self.grad_sampler(x, y), self.norm_ord)
        return out

    def state_dict(self) -> dict:
        """Wrapped optimizer state, steps taken, and the noise stream's state (empty in secure
        mode). The ledger and the sampler have state_dicts of their own."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "steps_taken": self.steps_taken,
            "randomness": self.randomness.state_dict(),
            "previous_private_gradient": self._prev_private,
        }

    def load_state_dict(self, state: dict) -> None:
        self._unshifted = None  # the model's weights come from the checkpoint, not from a lot in flight
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps_taken = int(state["steps_taken"])
        self.randomness.load_state_dict(state["randomness"])
        prev = state.get("previous_private_gradient")
        self._prev_private = None if prev is None else {n: t.clone() for n, t in prev.items()}
        self._reset_lot()
