"""Book-keeping (BK) clipping: the fast path for the clipped sum, one file per layer type.

The reference path (:mod:`dpcore.grad_sample` + :func:`dpcore.clipping.clipped_sum`) runs a
vmap'd backward per example. For layers whose per-example gradient is a function of the
layer's input and output gradient, it can be formed from one ordinary forward and one backward
of the *activations only* (Bu et al. 2023, "book-keeping"):

* forward hooks keep each registered layer's input ``a`` and output ``z``;
* one ``torch.autograd.grad(Σ_i loss_i, [z_1, …, z_L])`` gives the output gradients ``g``
  (no parameter gradients are computed at all);
* each layer's form (:class:`~.base.LayerForm`) adds its examples' squared gradient norms, in
  float64, and keeps what the clipped sum needs; the clip factors are the reference's (the same
  safety margin, the same skip-and-count of non-finite rows);
* each form's part then gives Σ_i f_i·grad_i for its parameters.

The forms, one file each: ``linear.py`` (``nn.Linear``, on vectors or sequences), ``conv.py``
(``nn.Conv2d``), ``wsconv.py`` (:class:`dpcore.layers.WSConv2d`), ``groupnorm.py``,
``layernorm.py`` and ``embedding.py`` (``nn.Embedding``), over the pieces they share
(``base.py``; ``norms.py``, the squared-norm helpers; ``sums.py``, the sparse and small-row
sums the clipper adds up). A new layer type is one file with a :class:`LayerForm` subclass,
one :func:`register_layer` line below, and one test against vmap
(``tests/dpcore/bookkeeping/test_clipped_sum_equals_vmap.py``: an entry of ``CASES`` in
``tests/dpcore/bookkeeping/_common.py``).

Models with any trainable parameter outside a registered layer (raw ``nn.Parameter`` attention
projections, grouped convolutions, ...), layers used more than once per forward, or a loss that
does not vmap, are not handled here: :func:`supports` says so and the caller uses the reference
path. Because the forms assume that examples are independent, :mod:`dpcore.fastpath` checks
them against vmap, in float64, before the first batch is summed (on inputs drawn from a
fixed seed in that batch's shapes, never the batch itself).
"""

from __future__ import annotations

from torch import nn

from ..layers import WSConv2d
from .base import Context, LayerForm, Part, SquaredNorms, Unsupported
from .clipper import BookKeepingClipper, supports, unsupported_parameters
from .conv import ConvForm
from .embedding import EmbeddingForm
from .groupnorm import GroupNormForm
from .layernorm import LayerNormForm
from .linear import LinearForm
from .registry import LAYERS, form_for, register_layer
from .wsconv import WSConvForm

register_layer(nn.Linear, LinearForm())
register_layer(nn.Conv2d, ConvForm())
register_layer(WSConv2d, WSConvForm())
register_layer(nn.GroupNorm, GroupNormForm())
register_layer(nn.LayerNorm, LayerNormForm())
register_layer(nn.Embedding, EmbeddingForm())

__all__ = [
    "LAYERS",
    "BookKeepingClipper",
    "Context",
    "LayerForm",
    "Part",
    "SquaredNorms",
    "Unsupported",
    "form_for",
    "register_layer",
    "supports",
    "unsupported_parameters",
]
