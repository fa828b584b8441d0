"""What a layer form's clipped sum comes as, besides a dense tensor: a :class:`RowUpdate` (a
token table's few rows) and :class:`SmallRows` (a bias's or a norm layer's per-example rows,
summed by the clipper with every other layer's in one product)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..clipping import weighted_sum


@dataclass
class RowUpdate:
    """A clipped sum that is non-zero only in some rows of a large parameter (a token table):
    ``rows[k]`` is added into row ``index[k]`` (an index may repeat; its rows add up). Added
    into a running sum directly, it never forms a tensor of the parameter's full size."""

    index: torch.Tensor  # [P] long
    rows: torch.Tensor  # [P, ...] float64
    shape: torch.Size

    def add_to(self, total: torch.Tensor) -> None:
        total.index_add_(0, self.index, self.rows.to(total.dtype))

    def dense(self) -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.rows.dtype, device=self.rows.device).index_add_(
            0, self.index, self.rows
        )


@dataclass
class SmallRows:
    """A parameter's per-example gradients as rows ``rows`` [B, k] (a bias, a norm layer's γ or
    β), rows of non-finite examples already zeroed: its clipped sum Σ_i f_i·rows_i is formed
    by the clipper together with every other layer's small rows of the same dtype, in one
    matrix product (on a GPU one launch in place of one per parameter)."""

    rows: torch.Tensor  # [B, k]
    param: torch.Tensor  # the parameter: the sum takes its shape


def small_rows_sums(factors: torch.Tensor, pending: list[SmallRows]) -> list[torch.Tensor]:
    """Σ_i f_i·rows_i of each of ``pending``, each float64 in its parameter's shape: the rows of
    one dtype joined and summed once (:func:`dpcore.clipping.weighted_sum`)."""
    out: list[torch.Tensor | None] = [None] * len(pending)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for k, r in enumerate(pending):
        by_dtype.setdefault(r.rows.dtype, []).append(k)
    for ks in by_dtype.values():
        joined = torch.cat([pending[k].rows for k in ks], dim=1) if len(ks) > 1 else pending[ks[0]].rows
        sums = weighted_sum(factors, joined).split([pending[k].rows.shape[1] for k in ks])
        for k, v in zip(ks, sums):
            out[k] = v.reshape(pending[k].param.shape)
    return out
