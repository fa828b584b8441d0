"""The registry of layer forms, by exact module type (a subclass may change the forward, so it
is not covered by its parent's form unless registered itself)."""

from __future__ import annotations

from torch import nn

from .base import LayerForm

LAYERS: dict[type[nn.Module], LayerForm] = {}


def register_layer(layer_type: type[nn.Module], form: LayerForm) -> LayerForm:
    """Book-keeping clipping handles modules of exactly ``layer_type`` with ``form``. Registering
    a type again replaces its form. Returns the form.

    What a form owes the guarantee: its squared norms never below the exact ones, each
    example's from that example alone; its clipped sums in float64 (checked); and, where a
    clipped sum adds anything other than each example's share (a ghost form's per-position
    products), the rounding of those terms through
    :meth:`~dpcore.bookkeeping.base.SquaredNorms.add_rounding`, so that it is held to the
    example's part of the clipping margin. The first batch checks a form against vmap, which
    catches wrong formulas, not a missing rounding term."""
    if not (isinstance(layer_type, type) and issubclass(layer_type, nn.Module)):
        raise TypeError(f"register_layer needs an nn.Module subclass, got {layer_type!r}")
    if not isinstance(form, LayerForm):
        raise TypeError(f"register_layer needs a LayerForm, got {type(form).__name__}")
    LAYERS[layer_type] = form
    return form


def form_for(m: nn.Module) -> LayerForm | None:
    """The form registered for ``m``'s exact type, if it accepts this instance."""
    form = LAYERS.get(type(m))
    return form if form is not None and form.accepts(m) else None
