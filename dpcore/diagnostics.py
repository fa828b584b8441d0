"""NON-PRIVATE diagnostics of the private step (BAM paper, Fig. 2, Fig. 4 and Appendix C).

Nothing here is noised or in the ledger. :class:`dpcore.DPOptimizer` computes these only with
``diagnostics=True``, and the platform then tags the run ``dp.diagnostics=non-private``.

Per step, all lot means over the realised count l (not qN):

* ``bias`` = ‖ĝ_clip − ĝ‖, the bias of DP-SGD's clipped mean at θ (the plain per-example
  gradients at θ for every method, so methods compare on the same quantity);
* ``magnitude_error_a`` = ⟨s/l, ĝ⟩/‖ĝ‖² with s the method's clipped sum before noise: for
  DP-SGD exactly Appendix C's (1/l)Σ η_i/M_i, for BAM/DP-SAT the same projection of their
  clipped vectors;
* ``direction_error_c`` = ‖(s + noise)/l − aĝ‖ and ``direction_error_c_clip`` = ‖s/l − aĝ‖;
* the cosines with ĝ of the per-example ascent directions g_i/‖g_i‖ (mean over i; BAM's) and
  of the previous released gradient (DP-SAT's).
"""

from __future__ import annotations

import torch

from .clipping import clip_factors, kept_rows, per_sample_norms

Params = dict[str, torch.Tensor]


class LotDiagnostics:
    def __init__(self, params: Params, clip_norm: float, norm_ord: int):
        self.params, self.clip_norm, self.norm_ord = params, clip_norm, norm_ord
        self.history: list[dict] = []
        self._acc: Params | None = None

    def reset(self) -> None:
        self._acc = None

    def accumulate(self, g: Params) -> None:
        """Add one physical batch's plain per-example gradients at θ."""
        if self._acc is None:
            device = next(iter(self.params.values())).device
            self._acc = {"count": torch.zeros((), dtype=torch.float64, device=device)}
            for key in ("sum", "clipped", "unit"):
                self._acc.update({f"{key}:{n}": torch.zeros_like(p) for n, p in self.params.items()})
        norms = per_sample_norms(g)
        factors, finite = clip_factors(norms if self.norm_ord == 2 else per_sample_norms(g, 1), self.clip_norm)
        finite = finite & torch.isfinite(norms)
        unit = torch.where(finite & (norms > 0), 1.0 / norms.clamp_min(1e-300), torch.zeros_like(norms))
        for n in self.params:
            gi = kept_rows(g[n], finite)
            self._acc[f"sum:{n}"].add_(gi.sum(0))
            self._acc[f"clipped:{n}"].add_(torch.einsum("i,i...->...", factors.to(gi.dtype), gi))
            self._acc[f"unit:{n}"].add_(torch.einsum("i,i...->...", unit.to(gi.dtype), gi))
        self._acc["count"] += float(finite.sum())

    def finish(self, clean: list[torch.Tensor], released: list[torch.Tensor], reduce_fn, previous, step: int) -> dict:
        """Reduce the lot's statistics across ranks (one extra all-reduce) and record the step.
        ``clean``: the method's clipped sum before noise; ``released``: the noised, reduced sum."""
        if self._acc is None:  # no example on this rank: contribute zeros to the reduction
            self.accumulate(
                {n: torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device) for n, p in self.params.items()}
            )
        names = list(self.params)
        tensors = [self._acc[f"{k}:{n}"] for k in ("sum", "clipped", "unit") for n in names] + clean
        count = self._acc["count"].to(released[0].dtype).reshape(1)
        if reduce_fn is not None:
            reduce_fn(tensors + [count])
        lot = max(float(count), 1.0)

        def flat(ts):
            return torch.cat([t.reshape(-1).double() for t in ts])

        k = len(names)
        g_hat = flat(tensors[:k]) / lot
        g_clip = flat(tensors[k : 2 * k]) / lot
        unit_sum = flat(tensors[2 * k : 3 * k])
        method_clip = flat(tensors[3 * k :]) / lot
        noised = flat(released) / lot
        gn = float(g_hat.norm())
        nan = float("nan")
        a = float(method_clip @ g_hat) / gn**2 if gn > 0 else nan
        rec = {
            "step": step,
            "examples": float(count),
            "grad_norm": gn,
            "bias": float((g_clip - g_hat).norm()),
            "magnitude_error_a": a,
            "direction_error_c": float((noised - a * g_hat).norm()) if gn > 0 else nan,
            "direction_error_c_clip": float((method_clip - a * g_hat).norm()) if gn > 0 else nan,
            "cos_per_example_ascent": float(unit_sum @ g_hat) / (lot * gn) if gn > 0 else nan,
            "cos_previous_private": nan,
        }
        if previous is not None and gn > 0:
            prev = flat([previous[n] for n in names])
            pn = float(prev.norm())
            if pn > 0:
                rec["cos_previous_private"] = float(prev @ g_hat) / (pn * gn)
        self.history.append(rec)
        return rec
