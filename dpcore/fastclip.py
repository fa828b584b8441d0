"""The old import path of book-keeping clipping, which now lives in :mod:`dpcore.bookkeeping`
(one file per layer type, and a registry)."""

from .bookkeeping import BookKeepingClipper, Unsupported, supports, unsupported_parameters

__all__ = ["BookKeepingClipper", "Unsupported", "supports", "unsupported_parameters"]
