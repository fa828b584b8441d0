"""A fast path for the clipped sum: book-keeping (BK) clipping for Linear, Conv2d,
weight-standardised Conv2d (:class:`dpcore.layers.WSConv2d`) and GroupNorm layers.

The reference path (:mod:`dpcore.grad_sample` + :func:`dpcore.clipping.clipped_sum`) runs a
vmap'd backward per example. For layers whose weight gradient is an outer product of the
layer's input and output gradient, the per-example gradient can be formed from one ordinary
forward and one backward of the *activations only* (Bu et al. 2023, "book-keeping"):

* forward hooks keep each supported layer's input ``a`` and output ``z``;
* one ``torch.autograd.grad(Σ_i loss_i, [z_1, …, z_L])`` gives the output gradients ``g``
  (no parameter gradients are computed at all);
* each example's gradient norm comes from ``a`` and ``g``: for a Linear layer on one vector
  per example, ‖a_iᵀ g_i‖ = ‖a_i‖·‖g_i‖ (the "ghost norm"); for sequences and convolutions
  (inputs unfolded to patches), from the per-example gradient ``g_iᵀ a_i`` or from the ghost
  form Σ_{t,s}(a_t·a_s)(g_t·g_s), whichever costs fewer operations;
* for convolutions of small patch size (the MNIST CNN's), the per-example weight gradients
  and their float64 squared norms come from a compiled kernel (:mod:`dpcore.native`) that
  skips the output-gradient entries that are exactly zero; elsewhere, or without a C
  compiler, from torch's grouped weight gradient;
* the clipped sum Σ_i f_i·g_iᵀa_i is one matrix product with the factors folded into ``g``;
* GroupNorm normalises each example alone: its γ and β gradients are Σ_positions g·x̂ and
  Σ g, with x̂ recomputed from the recorded input;
* a weight-standardised convolution uses ŵ(w): its per-example gradients are the
  standardisation's vector-Jacobian product of the per-example gradients for ŵ
  (:class:`_WSJacobian`, which also gives their norms in a ghost form).

Exactly the same clip factors as the reference (float64 norms, the same safety margin, the
same skip-and-count of non-finite rows). Models with any trainable parameter outside a
supported layer (LayerNorm, embeddings, grouped convolutions, ...), layers used
more than once per forward, or a loss that does not vmap, are not handled here:
:func:`supports` says so and the caller uses the reference path. Tests check that both paths
give the same clipped sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import native
from .clipping import clip_factors
from .grad_sample import LossFn
from .layers import WS_EPS, WSConv2d


def _conv_ok(m: nn.Conv2d) -> bool:
    return (
        type(m) in (nn.Conv2d, WSConv2d)
        and m.groups == 1
        and m.padding_mode == "zeros"
        and not isinstance(m.padding, str)
    )


def _altered(m: nn.Module) -> bool:
    """True if the layer's output may not be its plain Linear/Conv2d function of its input:
    user hooks (which may change inputs or outputs) or a forward replaced on the instance."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or "forward" in m.__dict__)


def _global_hooks() -> bool:
    from torch.nn.modules import module as _m

    return bool(_m._global_forward_hooks or _m._global_forward_pre_hooks or _m._global_backward_hooks)


def unsupported_parameters(model: nn.Module) -> list[str]:
    """Names of trainable parameters that the fast path cannot handle (empty: all handled).

    Handled: the weight (and bias) of ``nn.Linear``, plain ``nn.Conv2d`` and
    :class:`dpcore.layers.WSConv2d` layers (groups=1, zero padding given as numbers), with
    the weight trainable whenever the bias is; the affine parameters of ``nn.GroupNorm``;
    each parameter owned by one layer.
    """
    handled: dict[str, int] = {}
    problems: list[str] = []
    for mod_name, m in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if type(m) is nn.GroupNorm:
            if _altered(m):
                problems.append(prefix + "weight (the layer has hooks or a replaced forward)")
                continue
            for pname, p in m.named_parameters(recurse=False):
                handled[prefix + pname] = id(p)
            continue
        if (type(m) is nn.Linear) or (isinstance(m, nn.Conv2d) and _conv_ok(m)):
            if _altered(m):
                problems.append(prefix + "weight (the layer has hooks or a replaced forward)")
                continue
            if m.bias is not None and m.bias.requires_grad and not m.weight.requires_grad:
                problems.append(prefix + "bias (its weight is frozen)")
                continue
            for pname, p in m.named_parameters(recurse=False):
                handled[prefix + pname] = id(p)
    trainable = {n: id(p) for n, p in model.named_parameters() if p.requires_grad}
    problems += [n for n in trainable if handled.get(n) != trainable[n]]
    # Tied parameters: any trainable tensor reachable under two names (a head tied to an
    # embedding, say) is used outside one layer.
    seen: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad:
            if id(p) in seen and seen[id(p)] != n:
                problems.append(f"{n} (tied to {seen[id(p)]})")
            seen.setdefault(id(p), n)
    # A parameter shared by several layers appears once in named_parameters but is reached
    # through more than one layer: per-example gradients would have to be added across layers.
    shared = [n for n, pid in handled.items() if pid in trainable.values() and n not in trainable]
    problems += [f"{n} (shared)" for n in shared]
    return problems


def supports(model: nn.Module) -> bool:
    return not unsupported_parameters(model)


def _conv_per_example(m: nn.Conv2d, a: torch.Tensor, g: torch.Tensor, native_ok: bool = True):
    """``(W, sq)``: per-example weight gradients ``W`` [B, out, in·kh·kw] of a plain Conv2d
    (groups=1) from its input ``a`` [B, in, H, W] and output gradient ``g`` [B, out, H', W'],
    and their squared norms in float64 where the compiled kernel (:mod:`dpcore.native`) gave
    them, else ``None``."""
    if native_ok and native.worthwhile(m, g):
        got = native.conv2d_per_example(m, a, g)
        if got is not None:
            return got
    return _conv_per_example_torch(m, a, g), None


def _conv_per_example_torch(m: nn.Conv2d, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The torch form of :func:`_conv_per_example` (any device and dtype): ``W`` only."""
    batch = a.shape[0]
    if m.in_channels == 1:
        # W_i[o, p, q] = Σ_{y,x} a_pad[i, s_h·y + d_h·p, s_w·x + d_w·q] · g[i, o, y, x]: a forward
        # convolution of the padded input with g as the kernel (stride and dilation swap
        # roles), one group per example. With one input channel this is about twice as fast
        # as the grouped weight gradient below (measured: docs/benchmarks/README.md).
        (ph, pw), (kh, kw), (sh, sw), (dh, dw) = m.padding, m.kernel_size, m.stride, m.dilation
        out_h, out_w = g.shape[2], g.shape[3]
        ap = F.pad(a, (pw, pw, ph, ph)) if (ph or pw) else a
        ap = ap[:, :, : (out_h - 1) * sh + (kh - 1) * dh + 1, : (out_w - 1) * sw + (kw - 1) * dw + 1]
        W = F.conv2d(
            ap.reshape(1, batch, ap.shape[2], ap.shape[3]),
            g.reshape(batch * m.out_channels, 1, out_h, out_w),
            stride=(dh, dw),
            dilation=(sh, sw),
            groups=batch,
        )
        return W.reshape(batch, m.out_channels, kh * kw)
    # One convolution-weight gradient with the batch as groups (faster than patches + bmm).
    return torch.nn.grad.conv2d_weight(
        a.reshape(1, -1, *a.shape[2:]),
        (batch * m.out_channels, m.in_channels, *m.kernel_size),
        g.reshape(1, -1, *g.shape[2:]),
        stride=m.stride,
        padding=m.padding,
        dilation=m.dilation,
        groups=batch,
    ).reshape(batch, m.out_channels, -1)


# Squared norms of float32 rows are summed in float32 over chunks of this many elements, and
# the chunks in float64. For a sum of k non-negative terms the rounding error is at most
# (k−1)·u in any order (u = 2⁻²⁴), so with the squaring and the square root of
# ``vector_norm`` the squared norm is within (k+2)·u ≈ 1.1e-6 of exact, and the norm within
# 5.4e-7: inside the clipping margin of 1e-6 (dpcore.clipping.CLIP_MARGIN), so the clipped share
# still has norm ≤ C. It avoids a float64 copy of every per-example gradient.
_F32_CHUNK = 16
# Below this clipping bound, float32 underflow of squares (|w| < 1e-19) could matter
# relative to C²: then the rows are summed in float64.
_F32_MIN_CLIP = 1e-4


def _row_sq_norms(W: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """‖W_i‖² in float64 for each row of a 2-D tensor, with an error well inside the clipping
    margin (see ``_F32_CHUNK``). Non-finite chunks (overflow of float32 squares above ~1e19)
    are recomputed in float64, so a finite but huge gradient is clipped, not skipped."""
    rows, n = W.shape
    if W.dtype != torch.float32 or clip_norm < _F32_MIN_CLIP or n < 2 * _F32_CHUNK:
        return torch.linalg.vector_norm(W, dim=1, dtype=torch.float64).square()
    head = n - n % _F32_CHUNK
    sq = torch.linalg.vector_norm(W[:, :head].reshape(rows, -1, _F32_CHUNK), dim=2).double().square().sum(1)
    if head < n:
        sq += torch.linalg.vector_norm(W[:, head:], dim=1, dtype=torch.float64).square()
    if not bool(torch.isfinite(sq).all()):
        return torch.linalg.vector_norm(W, dim=1, dtype=torch.float64).square()
    return sq


def _is_plain_cross_entropy(loss_fn) -> bool:
    """``F.cross_entropy`` or an ``nn.CrossEntropyLoss`` with every option at its default."""
    if loss_fn is F.cross_entropy:
        return True
    return (
        type(loss_fn) is nn.CrossEntropyLoss
        and loss_fn.weight is None
        and loss_fn.ignore_index == -100
        and loss_fn.label_smoothing == 0.0
        and loss_fn.reduction == "mean"
        and not loss_fn._forward_hooks
        and not loss_fn._forward_pre_hooks
    )


def _groupnorm_per_example(m: nn.GroupNorm, a: torch.Tensor, g: torch.Tensor, sq: torch.Tensor):
    """Per-example gradients of a GroupNorm's γ and β ([B, C] each, None if frozen), their
    squared norms added into ``sq``. GroupNorm normalises each example on its own, so
    γ's gradient is Σ_positions g·x̂ with x̂ the example's normalised input, β's is Σ g."""
    batch, channels = a.shape[0], m.num_channels
    gg = g.reshape(batch, channels, -1)
    gamma = beta = None
    if m.weight is not None and m.weight.requires_grad:
        with torch.no_grad():
            xhat = F.group_norm(a, m.num_groups, None, None, m.eps).reshape(batch, channels, -1)
        gamma = (gg * xhat).sum(2)
        sq += torch.linalg.vector_norm(gamma, dim=1, dtype=torch.float64).square()
    if m.bias is not None and m.bias.requires_grad:
        beta = gg.sum(2)
        sq += torch.linalg.vector_norm(beta, dim=1, dtype=torch.float64).square()
    return gamma, beta


class _WSJacobian:
    """The weight standardisation ŵ = (w − μ)/s of a :class:`WSConv2d`, s = sqrt(σ² + ε), per
    output filter of n weights. Its vector-Jacobian product, for a gradient v with respect to
    ŵ (one filter), is (v − mean(v) − ŵ·mean(v ⊙ ŵ)) / s; with κ = ‖ŵ‖²/n = σ²/(σ² + ε) and
    ŵ ⟂ 1, ‖that‖² = (‖v‖² − (1ᵀv)²/n − (2 − κ)(ŵᵀv)²/n) / s². Everything in float64."""

    def __init__(self, m: nn.Conv2d):
        w = m.weight.detach().double().reshape(m.out_channels, -1)
        self.n = w.shape[1]
        mean = w.mean(1, keepdim=True)
        var = w.var(1, keepdim=True, unbiased=False)
        self.s = torch.sqrt(var + WS_EPS)  # [out, 1]
        self.w_hat = (w - mean) / self.s  # [out, n]
        self.kappa = self.w_hat.square().mean(1)  # [out]

    def vjp(self, v: torch.Tensor) -> torch.Tensor:
        """Gradients with respect to w from gradients ``v`` [..., out, n] with respect to ŵ,
        computed in float64 (``v`` is left as it is)."""
        return self.vjp_(v.to(torch.float64, copy=True)).to(v.dtype)

    def vjp_(self, v: torch.Tensor) -> torch.Tensor:
        """:meth:`vjp` in place, in ``v``'s own precision: for per-example gradients that are
        then measured as they are (their norms are taken from the result, so its rounding is
        what gets clipped)."""
        w_hat = self.w_hat.to(v.dtype)
        mean = v.mean(-1, keepdim=True)
        along = torch.einsum("...on,on->...o", v, w_hat).unsqueeze(-1).div_(self.n)
        v.sub_(mean).addcmul_(along, w_hat, value=-1.0)
        return v.div_(self.s.to(v.dtype))

    def ghost_sq_norms(self, A: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
        """Per-example ‖vjp(Σ_t G_t A_tᵀ)‖², never below the exact value, from patches A
        [B, n, T] and output gradients G [B, out, T] without forming the per-example gradients.

        The patches are centred first: the standardisation discards the mean direction, so
        with ṽ = Σ_t g_t Ã_t (Ã_t centred), ‖vjp(v)‖² = (‖ṽ‖² − (2 − κ)(ŵᵀṽ)²/n) / s², where
        ‖ṽ‖² comes from the Gram matrices and ŵᵀṽ from ŵ applied to the patches. The
        subtraction can cancel (v nearly along ŵ), so an allowance for float64 rounding is
        added, 8·(n + T)·u·(Σ_t ‖Ã_t‖·|g_t|)², which bounds every term's magnitude: the
        result can only overestimate the norm, which costs a smaller clip factor, never a
        share above C."""
        A, G = A.double(), G.double()
        A = A - A.mean(1, keepdim=True)
        T = A.shape[2]
        aa = A.transpose(1, 2) @ A  # [B, T, T]
        vv = ((aa @ G.transpose(1, 2)) * G.transpose(1, 2)).sum(1)  # [B, out]: ‖ṽ_o‖²
        w_v = ((self.w_hat @ A) * G).sum(2)  # [B, out]: ŵ_oᵀṽ_o
        bound = (G.abs() * torch.linalg.vector_norm(A, dim=1, keepdim=True)).sum(2).square()
        allowance = 8.0 * (self.n + T) * torch.finfo(torch.float64).eps * bound
        per_filter = (vv - (2.0 - self.kappa) * w_v.square() / self.n + allowance).clamp_min(0.0)
        return (per_filter / self.s.view(1, -1).square()).sum(1)


class Unsupported(Exception):
    """Raised during a call when the fast path cannot be used for this model/batch."""


class BookKeepingClipper:
    """Clipped sums of per-example gradients for models made of Linear/Conv2d parameters.

    Call :meth:`clipped_sum` (same contract as :func:`dpcore.clipping.clipped_sum` applied to
    per-example gradients of ``loss_fn(model(x_i), y_i)``). Raises ``ValueError`` at
    construction if :func:`supports` is false.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn):
        bad = unsupported_parameters(model)
        if bad:
            raise ValueError(f"the book-keeping path cannot handle these parameters: {bad[:5]}")
        self.model = model
        self.loss_fn = loss_fn
        self.layers = [
            (name, m)
            for name, m in model.named_modules()
            if (((type(m) is nn.Linear) or isinstance(m, nn.Conv2d)) and m.weight.requires_grad)
            or (type(m) is nn.GroupNorm and any(p.requires_grad for p in m.parameters(recurse=False)))
        ]
        self._per_sample_loss = torch.func.vmap(lambda out, target: loss_fn(out.unsqueeze(0), target.unsqueeze(0)))

    # ----------------------------------------------------------------------------------
    def _capture(self, x: torch.Tensor):
        # Re-checked at every call: hooks may be added after construction.
        if _global_hooks() or any(_altered(m) for _, m in self.layers):
            raise Unsupported("a layer has forward/backward hooks or a replaced forward")
        records: dict[str, list] = {name: [] for name, _ in self.layers}

        def hook_for(name):
            def hook(module, inputs, output):
                if not inputs or not isinstance(inputs[0], torch.Tensor):
                    raise Unsupported(f"layer {name} was not called with its input as a positional tensor")
                a = inputs[0]
                records[name].append((a.detach(), output, a._version, output._version))

            return hook

        handles = [m.register_forward_hook(hook_for(name)) for name, m in self.layers]
        try:
            out = self.model(x)
        except Unsupported:
            raise
        except Exception as e:  # let the reference path run (and raise, if the model is broken)
            raise Unsupported(f"the forward failed under book-keeping capture: {type(e).__name__}: {e}") from None
        finally:
            for h in handles:
                h.remove()
        if not isinstance(out, torch.Tensor):
            raise Unsupported("the model's output is not a single tensor")
        for name, rec in records.items():
            if len(rec) != 1:
                raise Unsupported(f"layer {name} ran {len(rec)} times in one forward")
            a, z, va, vz = rec[0]
            # An in-place op on a layer's input or output (ReLU(inplace=True), +=) after the layer
            # ran would make the recorded pair wrong.
            if a._version != va or z._version != vz:
                raise Unsupported(f"the input or output of layer {name} was modified in place")
            if a.shape[0] != x.shape[0] or z.shape[0] != x.shape[0] or not z.requires_grad:
                raise Unsupported(f"layer {name} does not see the batch on dim 0 with gradients")
        return out, {name: rec[0][:2] for name, rec in records.items()}

    def clipped_sum(self, x: torch.Tensor, y: torch.Tensor, clip_norm: float, out: dict[str, torch.Tensor]) -> int:
        """Add Σ_i clip(g_i) into ``out`` (a dict of parameter name → tensor). Returns the
        number of examples skipped for a non-finite gradient."""
        batch = x.shape[0]
        if batch == 0:
            return 0
        with torch.enable_grad():
            logits, rec = self._capture(x)
            try:
                losses = self._per_example_losses(logits, y)
            except Exception as e:
                raise Unsupported(f"the loss does not vmap over examples: {type(e).__name__}: {e}") from None
            if losses.shape != (batch,):
                raise Unsupported(f"the loss gives shape {tuple(losses.shape)} per batch, not one value per example")
            outputs = [rec[name][1] for name, _ in self.layers]
            grads = torch.autograd.grad(losses.sum(), outputs, allow_unused=True)
        # Per layer: (name, module, kind, data). Kinds: "materialised" (per-example weight
        # gradients W [B, out, in]), "ghost" (patches A and output gradients G, norms from
        # their Gram matrices), "groupnorm" (per-example γ and β gradients).
        parts: list[tuple] = []
        sq = torch.zeros(batch, dtype=torch.float64, device=x.device)
        for (name, m), g in zip(self.layers, grads):
            a = rec[name][0]
            if g is None:
                g = torch.zeros_like(rec[name][1])
            if isinstance(m, nn.GroupNorm):
                parts.append((name, m, "groupnorm", _groupnorm_per_example(m, a, g, sq)))
                continue
            ws = type(m) is WSConv2d
            if isinstance(m, nn.Conv2d):
                G = g.reshape(batch, g.shape[1], -1)  # [B, c, T]
                if batch * m.weight.numel() <= self.MAX_PER_EXAMPLE_ELEMENTS:
                    W, w_sq = _conv_per_example(m, a, g)  # [B, out, in·kh·kw]: gradients for the weight used
                    if ws:  # ... which is ŵ(w): back through the standardisation, per example
                        W, w_sq = _WSJacobian(m).vjp_(W), None
                    sq += w_sq if w_sq is not None else _row_sq_norms(W.reshape(batch, -1), clip_norm)
                    bias_g = self._bias(m, G.sum(2), sq)
                    parts.append((name, m, "materialised", (W, bias_g)))
                    continue
                # Patches [B, d, T] and output gradients [B, c, T]: both in their natural layout.
                A = F.unfold(a, m.kernel_size, dilation=m.dilation, padding=m.padding, stride=m.stride)
                channels_first = True
            else:
                A = a.reshape(batch, -1, a.shape[-1])  # [B, T, d_in]
                G = g.reshape(batch, -1, g.shape[-1])  # [B, T, d_out]
                channels_first = False
            post = None
            if ws:
                jac = _WSJacobian(m)
                sq += jac.ghost_sq_norms(A, G)
                post = jac.vjp
                per_example = None
            else:
                s, per_example = self._weight_sq_norms(A, G, channels_first, clip_norm)
                sq += s
            bias_g = self._bias(m, G.sum(2) if channels_first else G.sum(1), sq)
            if per_example is not None:
                parts.append((name, m, "materialised", (per_example, bias_g)))
            else:
                parts.append((name, m, "ghost", (A, G, channels_first, bias_g, post)))
        factors, finite = clip_factors(sq.sqrt(), clip_norm)
        n_bad = int((~finite).sum())
        # A factor below the dtype's smallest normal number loses precision when cast (a gradient
        # of norm ≳1e32·C in float32): then this batch is summed in float64, as the reference does.
        tiny = max(torch.finfo(next(m.parameters()).dtype).tiny for _, m in self.layers) * 2.0**24
        wide = bool(((factors < tiny) & finite).any())
        keep2 = finite.view(-1, 1)
        contributions: list[tuple[str, torch.Tensor]] = []

        def drop_bad(t):  # skip-and-count: those rows contribute exactly zero (never NaN·0)
            if t is None or not n_bad:
                return t
            return torch.where(keep2.view(-1, *([1] * (t.dim() - 1))), t, torch.zeros((), dtype=t.dtype))

        for name, m, kind, data in parts:
            prefix = f"{name}." if name else ""
            pdtype = m.weight.dtype if m.weight is not None else m.bias.dtype
            dtype = torch.float64 if wide else pdtype
            f = factors.to(dtype)
            if kind == "groupnorm":
                for pname, per_example in zip(("weight", "bias"), data):
                    if per_example is not None:
                        contributions.append((prefix + pname, (f @ drop_bad(per_example).to(dtype)).to(pdtype)))
                continue
            if kind == "materialised":  # Σ_i f_i W_i from the per-example gradients
                per_example, bias_g = data
                pe = drop_bad(per_example).to(dtype)
                w = f @ pe.reshape(pe.shape[0], -1)  # one matrix-vector product
            else:
                # Ghost-norm layers: Σ_i f_i G_iᵀA_i over (example, position). With several
                # positions the sum runs in float64, so that each example's share keeps the norm
                # the factor was computed for (float32 accumulation over many positions could
                # exceed the 1e-6 clipping margin).
                A, G, channels_first, bias_g, post = data
                A, G = drop_bad(A), drop_bad(G)
                acc = dtype if (A.shape[2 if channels_first else 1] == 1 and post is None) else torch.float64
                if channels_first:
                    w = torch.einsum("b,bct,bdt->cd", f.to(acc), G.to(acc), A.to(acc))
                else:  # (f·G) over all (example, position) rows, transposed, times A: one matmul
                    Gf = G.to(acc) * f.to(acc).view(-1, 1, 1)
                    w = Gf.reshape(-1, Gf.shape[2]).t() @ A.to(acc).reshape(-1, A.shape[2])
                if post is not None:  # the standardisation's VJP is linear: applied to the sum
                    w = post(w)
                w = w.to(dtype)
            contributions.append((prefix + "weight", w.reshape(m.weight.shape).to(pdtype)))
            if bias_g is not None:
                contributions.append((prefix + "bias", (f @ drop_bad(bias_g).to(dtype)).to(m.bias.dtype)))
        for key, value in contributions:  # all computed first: nothing is added if anything above fails
            self._add(out, key, value)
        return n_bad

    def _per_example_losses(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """loss_fn(logits[i:i+1], y[i:i+1]) for every i. For plain cross-entropy that is
        ``reduction="none"`` (one kernel instead of a vmap); anything else is vmapped."""
        if _is_plain_cross_entropy(self.loss_fn) and logits.dim() == 2 and y.dim() == 1 and not y.is_floating_point():
            # ignore_index (-100) would give NaN per example under the mean reduction, 0 here.
            if bool((y >= 0).all()):
                return F.cross_entropy(logits, y, reduction="none")
        return self._per_sample_loss(logits, y)

    @staticmethod
    def _bias(m: nn.Module, per_example_bias: torch.Tensor, sq: torch.Tensor):
        """Per-example bias gradients (Σ over positions of G), their norms added into ``sq``."""
        if m.bias is None or not m.bias.requires_grad:
            return None
        sq += torch.linalg.vector_norm(per_example_bias, dim=1, dtype=torch.float64).square()
        return per_example_bias

    # Materialise per-example weight gradients (B × out × in floats) up to this many elements.
    MAX_PER_EXAMPLE_ELEMENTS = 64 * 2**20

    def _weight_sq_norms(self, A: torch.Tensor, G: torch.Tensor, channels_first: bool, clip_norm: float):
        """(‖W_i‖_F² per example in float64, the per-example gradients W_i or None), by the
        cheaper exact form: W_i = G_iᵀA_i materialised, or the ghost Σ_{t,s}(a_t·a_s)(g_t·g_s)."""
        if channels_first:  # A [B, d, T], G [B, c, T]
            B, d, T = A.shape
            c = G.shape[1]
        else:  # A [B, T, d], G [B, T, c]
            B, T, d = A.shape
            c = G.shape[2]
        if T == 1:
            a, g = (A[:, :, 0], G[:, :, 0]) if channels_first else (A[:, 0], G[:, 0])
            sq = (
                torch.linalg.vector_norm(a, dim=1, dtype=torch.float64).square()
                * torch.linalg.vector_norm(g, dim=1, dtype=torch.float64).square()
            )
            return sq, None
        # (Convolutions reach here only when materialising is over budget: the ghost form.)
        if not channels_first and B * c * d <= self.MAX_PER_EXAMPLE_ELEMENTS and T * d * c <= 4 * T * T * (d + c):
            W = G.transpose(1, 2) @ A  # [B, c, d]
            return _row_sq_norms(W.reshape(B, -1), clip_norm), W
        if channels_first:
            aa = A.transpose(1, 2).double() @ A.double()  # [B, T, T]
            gg = G.transpose(1, 2).double() @ G.double()
        else:
            aa = A.double() @ A.double().transpose(1, 2)
            gg = G.double() @ G.double().transpose(1, 2)
        return (aa * gg).sum(dim=(1, 2)), None

    @staticmethod
    def _add(out: dict, key: str, value: torch.Tensor) -> None:
        if key in out:
            out[key].add_(value.to(out[key].dtype))
        else:
            out[key] = value
