"""The host's reads of the device in a book-keeping clipped sum, counted on any machine.

On a GPU, every read of a value (``bool(t)``, ``int(t)``, ``t.item()``, ``t.tolist()``) and every
operation whose output size depends on values (``nonzero``, ``unique``, a boolean mask) makes
the host wait for the queued work, and a computation with such a wait inside cannot be captured
as a CUDA graph. tests/dpcore/test_on_cuda.py counts the waits on a GPU; this counts the same
reads here, on the CPU that CI has: by a ``TorchDispatchMode`` below autograd (a value read
from Python or from inside torch is a ``_local_scalar_dense``), and ``tolist``, which on a CPU
reads memory without an operation, by wrapping it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dpcore import native
from dpcore.bookkeeping import BookKeepingClipper

from .bookkeeping._common import CASES, TinyText

# Operations that read the device: a value to the host (``_local_scalar_dense``: ``bool``,
# ``int``, ``float``, ``.item()``, from Python or from inside torch), or an output sized by values.
READS = {
    "_local_scalar_dense", "nonzero", "nonzero_numpy", "argwhere", "unique", "_unique", "_unique2", "unique_dim",
    "unique_consecutive", "unique_dim_consecutive", "masked_select", "equal", "is_nonzero", "allclose", "bincount",
    "histc",
}  # fmt: skip


class DeviceReads(TorchDispatchMode):
    def __init__(self, seen: list):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in READS:
            self.seen.append(name)
        elif name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or ()):
                self.seen.append(f"{name} with a boolean mask")
        elif name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and "output_size" not in (kwargs or {}):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def reads_of(fn, *args, monkeypatch) -> list[str]:
    """The reads of the device that ``fn(*args)`` makes, in order. ``tolist`` is watched from
    Python: on a CPU it reads memory without an operation."""
    seen: list[str] = []
    real = torch.Tensor.tolist

    def tolist(self, *a, **k):
        seen.append("tolist")
        return real(self, *a, **k)

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", tolist)
        with DeviceReads(seen):
            fn(*args)
    return seen


class Deep(nn.Module):  # 6 Linear layers over 5 positions, each with materialised per-example gradients
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))
        self.head = nn.Linear(32, 4)

    def forward(self, x):  # x [B, 5, 32]
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x.mean(1))


MODELS = CASES + [("deep", Deep, (5, 32), 4), ("text", lambda: TinyText(), None, 3)]


@pytest.mark.parametrize("ghost", [False, True], ids=["materialised", "ghost"])
@pytest.mark.parametrize("name, make, shape, classes", MODELS, ids=[c[0] for c in MODELS])
def test_a_clipped_sum_reads_the_device_once_whatever_its_layers(name, make, shape, classes, ghost, monkeypatch):
    """On the torch path a GPU takes (the compiled CPU convolution kernel off), for every layer
    type the clipper has a form for, in both forms, with an ignored label in the batch: one
    read, the count of non-finite and tiny clip factors, which also tells whether a float32
    square overflowed."""
    monkeypatch.setattr(native, "load", lambda: None)
    torch.manual_seed(0)
    model = make()
    g = torch.Generator().manual_seed(1)
    if shape is None:
        x = torch.randint(0, 8, (16, 10), generator=g)
    else:
        x = torch.randn(16, *shape, generator=g).to(next(model.parameters()).dtype)
    model(x[:1])  # materialise lazy layers
    y = torch.randint(0, classes, (16,), generator=g)
    y[3] = -100  # an ignored label (its example's gradient is zero): once read on the host
    bk = BookKeepingClipper(model, F.cross_entropy)
    if ghost:
        bk.MAX_PER_EXAMPLE_ELEMENTS = 0
    assert bk.clipped_sum(x, y, 1.0, {}) == 0
    seen = reads_of(bk.clipped_sum, x, y, 1.0, {}, monkeypatch=monkeypatch)
    assert seen == ["tolist"], seen


def test_the_counter_sees_each_kind_of_read(monkeypatch):
    """Else the test above could pass on reads that the counter does not recognise."""
    t, y = torch.tensor([0.0, 1.0, -1.0]), torch.tensor([0, 2, 1])
    for read in [
        lambda: bool(t.sum() > 0),
        lambda: int(t[1]),
        lambda: t.tolist(),
        lambda: t[t > 0],
        lambda: torch.unique(t),
        lambda: t.nonzero(),
        lambda: torch.repeat_interleave(t, torch.tensor([1, 2, 0])),
        lambda: F.one_hot(y),  # reads inside torch (its number of classes)
        lambda: torch.bincount(y),
        lambda: torch.allclose(t, t),
    ]:
        assert reads_of(read, monkeypatch=monkeypatch), read
