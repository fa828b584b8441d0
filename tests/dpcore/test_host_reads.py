"""The host's reads of the device in a book-keeping clipped sum, counted on any machine.

On a GPU, every read of a value (``bool(t)``, ``t.item()``) and every operation whose output
size depends on values (``nonzero``, ``unique``, a boolean mask) makes the host wait for the
device, and a computation with such a wait inside cannot be captured as a CUDA graph.
tests/dpcore/test_on_cuda.py counts the waits on a GPU; this counts here, on the CPU that CI
has, the reads that show as operations below autograd (a ``TorchDispatchMode``). One kind does
not show: ``.tolist()``, which on a CPU reads memory without an operation, so the clipper's one
``tolist`` per batch (the count of non-finite and tiny clip factors) is not in these counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dpcore import native
from dpcore.bookkeeping import BookKeepingClipper

from .test_bookkeeping_clipping import CASES
from .test_bookkeeping_text_layers import TinyText

# Operations that read the device: a value to the host, or an output sized by values.
READS = {
    "_local_scalar_dense", "nonzero", "nonzero_numpy", "argwhere", "unique", "_unique", "_unique2", "unique_dim",
    "unique_consecutive", "unique_dim_consecutive", "masked_select", "_assert_async", "equal", "is_nonzero",
}  # fmt: skip


class Reads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in READS:
            self.seen.append(name)
        elif name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            indices = args[1] if len(args) > 1 else ()
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
                self.seen.append(f"{name} with a boolean mask")
        elif name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and "output_size" not in (kwargs or {}):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


TEXT = ("text", lambda: TinyText(), None, 3)


@pytest.mark.parametrize("ghost", [False, True], ids=["materialised", "ghost"])
@pytest.mark.parametrize("name, make, shape, classes", CASES + [TEXT], ids=[c[0] for c in CASES + [TEXT]])
def test_a_clipped_sum_reads_the_device_at_most_once_whatever_its_layers(
    name, make, shape, classes, ghost, monkeypatch
):
    """The torch path a GPU takes (the compiled CPU convolution kernel off), every layer type
    the clipper has a form for, both forms. The one read allowed is the check that no float32
    square of a materialised gradient overflowed."""
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
    with Reads() as reads:
        assert bk.clipped_sum(x, y, 1.0, {}) == 0
    assert len(reads.seen) <= 1, reads.seen


def test_the_counter_sees_the_reads_it_is_meant_to():
    """The counter itself: each kind of read it lists is seen (else the test above could pass
    on reads it does not recognise)."""
    t = torch.tensor([0.0, 1.0, -1.0])
    with Reads() as reads:
        bool(t.sum() > 0)
        t[t > 0]
        torch.unique(t)
        t.nonzero()
        t.masked_select(t > 0)
        torch.repeat_interleave(t, torch.tensor([1, 2, 0]))
    assert reads.seen[0] == "_local_scalar_dense" and len(reads.seen) == 6, reads.seen
