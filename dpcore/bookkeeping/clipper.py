"""The book-keeping clipper: one forward with hooks, one backward of the activations only, and
each registered layer form's per-example norms and clipped sums."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..clipping import ADD_GROUP_BYTES, clip_factors, kept_rows
from ..grad_sample import LossFn
from ..precision import check_autocast, formulas, forward_autocast, widen
from .base import Context, SquaredNorms, Unsupported
from .registry import form_for
from .sums import RowUpdate, SmallRows, small_rows_sums


def altered(m: nn.Module) -> bool:
    """True if the layer's output may not be its plain function of its input: user hooks
    (which may change inputs or outputs) or a forward replaced on the instance."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or "forward" in m.__dict__)


def global_hooks() -> bool:
    from torch.nn.modules import module as _m

    return bool(_m._global_forward_hooks or _m._global_forward_pre_hooks or _m._global_backward_hooks)


def unsupported_parameters(model: nn.Module) -> list[str]:
    """Names of trainable parameters that the fast path cannot handle (empty: all handled).

    Handled: the parameters of layers whose exact type has a registered form
    (:data:`dpcore.bookkeeping.LAYERS`) that accepts the instance, each parameter owned by one
    layer, with no hooks or replaced forward on the layer.
    """
    handled: dict[str, int] = {}
    problems: list[str] = []
    for mod_name, m in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        form = form_for(m)
        if form is None:
            continue
        if altered(m):
            problems.append(prefix + "weight (the layer has hooks or a replaced forward)")
            continue
        refused = form.problems(m)
        if refused:
            problems += [prefix + r for r in refused]
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


def is_plain_cross_entropy(loss_fn) -> bool:
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


class BookKeepingClipper:
    """Clipped sums of per-example gradients for models made of registered layer types.

    Call :meth:`clipped_sum` (same contract as :func:`dpcore.clipping.clipped_sum` applied to
    per-example gradients of ``loss_fn(model(x_i), y_i)``). Raises ``ValueError`` at
    construction if :func:`supports` is false. With ``autocast="bf16"`` the forward (and so the
    activations' backward) runs under bf16 autocast; each layer's recorded input and output
    gradient are widened to its parameters' dtype before the formulas, which run outside
    autocast (:mod:`dpcore.precision`).
    """

    # Materialise per-example weight gradients (B × out × in floats) up to this many elements
    # (512 MiB of float32 for one layer: ResNet-9's 256→512 convolution at batch 64 takes 302 MiB,
    # and materialised it clips in about half the time of its ghost form).
    MAX_PER_EXAMPLE_ELEMENTS = 128 * 2**20

    def __init__(self, model: nn.Module, loss_fn: LossFn, autocast: str = "none"):
        self.autocast = check_autocast(autocast)
        bad = unsupported_parameters(model)
        if bad:
            raise ValueError(f"the book-keeping path cannot handle these parameters: {bad[:5]}")
        self.model = model
        self.loss_fn = loss_fn
        self.layers = [
            (name, m, form)
            for name, m in model.named_modules()
            if (form := form_for(m)) is not None and any(p.requires_grad for p in m.parameters(recurse=False))
        ]
        self._per_sample_loss = torch.func.vmap(lambda out, target: loss_fn(out.unsqueeze(0), target.unsqueeze(0)))

    # ----------------------------------------------------------------------------------
    def _capture(self, x: torch.Tensor):
        # Re-checked at every call: hooks may be added after construction.
        if global_hooks() or any(altered(m) for _, m, _ in self.layers):
            raise Unsupported("a layer has forward/backward hooks or a replaced forward")
        records: dict[str, list] = {name: [] for name, _, _ in self.layers}

        def hook_for(name):
            def hook(module, inputs, output):
                if not inputs or not isinstance(inputs[0], torch.Tensor):
                    raise Unsupported(f"layer {name} was not called with its input as a positional tensor")
                a = inputs[0]
                records[name].append((a.detach(), output, a._version, output._version))

            return hook

        handles = [m.register_forward_hook(hook_for(name)) for name, m, _ in self.layers]
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

    def clipped_sum(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        clip_norm: float,
        out: dict[str, torch.Tensor],
        batch_size: int | None = None,
    ) -> int:
        """Add Σ_i clip(g_i) into ``out`` (a dict of parameter name → tensor). Returns the
        number of examples skipped for a non-finite gradient. ``batch_size``: the configured
        physical batch size, at least the batch's (the default), at which the bound on rounding
        is taken (:func:`dpcore.clipping.rounding_floor`)."""
        if x.shape[0] == 0:
            return 0
        sq, parts, exact = self._measure(x, y, clip_norm, batch_size)
        factors, finite = clip_factors(sq.sqrt(), clip_norm)
        n_bad = self.nonfinite(finite)  # the batch's one read of the device
        if exact is not None and n_bad:
            # A norm is not finite: a float32 square may have overflowed, so the row norms are
            # measured again in float64 (as measure() does), and the count read again.
            del parts, factors, finite  # the first pass's per-example gradients go first
            first, (sq, parts) = sq, exact()
            sq = self.kept_where_finite(first, sq)
            factors, finite = clip_factors(sq.sqrt(), clip_norm)
            n_bad = self.nonfinite(finite)
        del exact  # the activations and output gradients it holds
        # Each parameter's float64 sum is added into ``out`` once a group of them reaches
        # ADD_GROUP_BYTES (one multi-tensor add per group: one kernel on a GPU), so that the
        # batch's sums never all live at once (8 bytes per parameter on top of the step's peak).
        # A layer form raises Unsupported only while measuring, before anything is added; one
        # raised later must not send the batch to the vmap path, which would add it again.
        targets, values, size, added = [], [], 0, False
        try:
            for key, value in self._each_contribution(parts, factors, finite, True, n_bad):
                if key not in out:
                    out[key] = value.dense() if isinstance(value, RowUpdate) else value
                elif isinstance(value, RowUpdate):
                    value.add_to(out[key])
                    added = True
                else:
                    targets.append(out[key])
                    values.append(value)
                    size += value.numel() * value.element_size()
                    if size >= ADD_GROUP_BYTES:
                        torch._foreach_add_(targets, values)
                        targets, values, size, added = [], [], 0, True
        except Unsupported as e:
            if added:
                raise RuntimeError(f"a layer form failed after part of the batch was added: {e}") from e
            raise
        if targets:
            torch._foreach_add_(targets, values)
        return n_bad

    def measure(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        clip_norm: float,
        batch_size: int | None = None,
        norms: list | None = None,
    ) -> tuple[torch.Tensor, list]:
        """(each example's squared gradient norm, float64 [B]; each layer's part). The parts give
        Σ_i f_i·grad_i for any factors through :meth:`contributions`. ``clip_norm`` sets the
        precision the norms need (see :func:`dpcore.bookkeeping.norms.row_sq_norms`);
        ``batch_size`` as in :meth:`clipped_sum`; ``norms``, a list the
        :class:`~dpcore.bookkeeping.base.SquaredNorms` the forms added into is appended to (what
        they measured and the allowances they added: :meth:`SquaredNorms.measured`)."""
        sq, parts, exact = self._measure(x, y, clip_norm, batch_size, norms)
        if exact is not None and not bool(torch.isfinite(sq).all()):
            # A float32 square overflowed (or a gradient is not finite): the row norms in float64.
            del parts  # the first pass's per-example gradients go before the second's are made
            first, (sq, parts) = sq, exact()
            sq = self.kept_where_finite(first, sq)
        return sq, parts

    @staticmethod
    def kept_where_finite(first: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
        """The first pass's squared norms where they are finite, the float64 pass's elsewhere: an
        example's norm, and so its factor, never depends on whether another example in its batch
        overflowed (the per-example gradients are the same in both passes; only how their rows
        are measured differs)."""
        return torch.where(torch.isfinite(first), first, exact)

    def _measure(
        self, x: torch.Tensor, y: torch.Tensor, clip_norm: float, batch_size: int | None, norms: list | None = None
    ):
        """:meth:`measure` without its read of the device: (sq, parts, exact), ``exact`` None
        where every row norm was summed in float64, else a callable that measures the batch
        again that way, for a batch where a float32 square may have overflowed (a norm that is
        not finite). The caller reads the norms once, with the count of non-finite examples."""
        batch = x.shape[0]
        with torch.enable_grad():
            with forward_autocast(self.autocast, x):
                logits, rec = self._capture(x)
                try:
                    losses = self._per_example_losses(logits, y)
                except Exception as e:
                    raise Unsupported(f"the loss does not vmap over examples: {type(e).__name__}: {e}") from None
            if losses.shape != (batch,):
                raise Unsupported(f"the loss gives shape {tuple(losses.shape)} per batch, not one value per example")
            outputs = [rec[name][1] for name, _, _ in self.layers]
            grads = torch.autograd.grad(losses.sum(), outputs, allow_unused=True)
        # Each layer's form adds its examples' squared norms into sq and keeps what it needs for
        # the clipped sum (per-example gradients, or the activations of a ghost form).
        ctx = Context(clip_norm=clip_norm, max_elements=self.MAX_PER_EXAMPLE_ELEMENTS, batch_size=batch_size)
        with formulas(x):  # autocast off, whatever region the caller opened
            sq, parts = self._forms(rec, grads, x, ctx, batch_size, norms)
        if not ctx.float32_rows:
            return sq, parts, None

        def exact():
            with formulas(x):
                again = Context(clip_norm, ctx.max_elements, exact_rows=True, batch_size=batch_size)
                return self._forms(rec, grads, x, again, batch_size, norms)

        return sq, parts, exact

    def _forms(
        self, rec: dict, grads, x: torch.Tensor, ctx: Context, batch_size: int | None, norms: list | None = None
    ) -> tuple[torch.Tensor, list]:
        sq = SquaredNorms(x.shape[0], x.device, batch_size)
        if norms is not None:
            norms.append(sq)
        parts = []
        for (name, m, form), g in zip(self.layers, grads):
            a, z = rec[name]
            pdtype = next(p for p in m.parameters(recurse=False)).dtype
            g = widen(g if g is not None else torch.zeros_like(z), pdtype)
            parts.append((name, form.per_example(m, widen(a, pdtype), g, sq, ctx)))
        return sq.total(), parts

    @staticmethod
    def nonfinite(finite: torch.Tensor) -> int:
        """How many examples are not finite: one read of the device."""
        return int((~finite).sum().tolist())

    def contributions(
        self, parts: list, factors: torch.Tensor, finite: torch.Tensor, rows: bool = False, n_bad: int | None = None
    ) -> list[tuple[str, torch.Tensor | RowUpdate]]:
        """(parameter name, Σ_i f_i·grad_i in float64) for every trainable parameter, every sum
        over examples accumulated in float64 (:func:`dpcore.clipping.weighted_sum`); the rows
        where ``finite`` is false contribute exactly zero (``n_bad``: how many, if already
        read). With ``rows``, a parameter whose sum is non-zero only in some rows (a token
        table) comes as a :class:`RowUpdate` to add into a running sum; else every sum is a
        dense tensor."""
        return list(self._each_contribution(parts, factors, finite, rows, n_bad))

    def _each_contribution(self, parts, factors, finite, rows, n_bad):
        """:meth:`contributions`, one at a time (the small rows of all layers last, summed
        together). Raises Unsupported for a sum that is not float64 (a layer form from outside
        this package that forms its sum in another dtype)."""
        with formulas(factors):  # autocast off, whatever region the caller opened
            if n_bad is None:
                n_bad = self.nonfinite(finite)

            def drop_bad(t):  # skip-and-count: those rows contribute exactly zero (never NaN·0)
                return t if t is None or not n_bad else kept_rows(t, finite)

            small = []
            for name, part in parts:
                for pname, value in part.contributions(factors, drop_bad):
                    key = f"{name}.{pname}" if name else pname
                    if isinstance(value, SmallRows):
                        small.append((key, value))
                        continue
                    if isinstance(value, RowUpdate) and not rows:
                        value = value.dense()
                    dtype = (value.rows if isinstance(value, RowUpdate) else value).dtype
                    if dtype != torch.float64:
                        raise Unsupported(
                            f"the layer form of {name or 'the model'} gave a {dtype} clipped sum for "
                            f"{pname}; sums over examples must be float64 (dpcore.clipping.weighted_sum)"
                        )
                    yield key, value
            if small:
                yield from zip([k for k, _ in small], small_rows_sums(factors, [v for _, v in small]))

    def _per_example_losses(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """loss_fn(logits[i:i+1], y[i:i+1]) for every i. For plain cross-entropy that is
        ``reduction="none"`` (one kernel instead of a vmap); anything else is vmapped."""
        if is_plain_cross_entropy(self.loss_fn) and logits.dim() == 2 and y.dim() == 1 and not y.is_floating_point():
            # An ignored label (ignore_index, -100) has loss 0 here and 0/0 = NaN in the vmapped
            # mean, and a zero gradient in both; only the gradient is used. So y is not read on
            # the host, which on a GPU would wait for the device.
            return F.cross_entropy(logits, y, reduction="none")
        return self._per_sample_loss(logits, y)
