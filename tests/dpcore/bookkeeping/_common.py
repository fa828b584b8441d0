"""Models and helpers shared by the book-keeping tests (and by tests/dpcore/test_host_reads.py
and tests/dpcore/test_on_cuda.py): the zoo of models checked against the per-example (vmap)
reference (CASES, with the sequence, weight-standardised/GroupNorm, LayerNorm and convolution
models it is made of), the text model, the reference clipped sum, and an optimizer on the
book-keeping path."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import dpcore
from dpcore.clipping import clipped_sum
from dpcore.grad_sample import PerSampleGradients
from pipelines.models import build_model, resnet9

ce = F.cross_entropy


class SeqModel(nn.Module):
    """Linear layers applied to a sequence (T positions per example), then pooled."""

    def __init__(self, d=6, hidden=12):
        super().__init__()
        self.a = nn.Linear(d, hidden)
        self.b = nn.Linear(hidden, 4, bias=False)

    def forward(self, x):  # x [B, T=5, d]
        return self.b(torch.tanh(self.a(x))).mean(1)


def conv_zoo():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, (3, 2), dilation=(1, 2), padding=(2, 1), bias=False),
        nn.Tanh(),
        nn.Flatten(),
        nn.LazyLinear(5),
    )


def ws_gn_net():
    """Weight-standardised convolutions (with and without bias, strided, one input channel),
    GroupNorm with and without frozen parts, a residual, GroupNorm on flat features."""
    from dpcore.layers import WSConv2d

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = WSConv2d(1, 6, 3, padding=1)
            self.g1 = nn.GroupNorm(3, 6)
            self.c2 = WSConv2d(6, 6, 3, padding=1, bias=False)
            self.g2 = nn.GroupNorm(2, 6)
            self.g2.bias.requires_grad_(False)
            self.c3 = WSConv2d(6, 4, 2, stride=2)
            self.head = nn.Linear(4 * 4 * 5, 8)
            self.g3 = nn.GroupNorm(2, 8)
            self.out = nn.Linear(8, 5)

        def forward(self, x):
            h = torch.relu(self.g1(self.c1(x)))
            h = h + torch.tanh(self.g2(self.c2(h)))
            h = self.c3(h).flatten(1)
            return self.out(torch.relu(self.g3(self.head(h))))

    return Net()


class NormSeq(nn.Module):
    """LayerNorm over a sequence's last dimension (one with a frozen bias, one without affine
    parameters), over its last two dimensions, and on flat features."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 12)
        self.n1 = nn.LayerNorm(12)
        self.n1.bias.requires_grad_(False)
        self.n2 = nn.LayerNorm((5, 12))
        self.n3 = nn.LayerNorm(12, elementwise_affine=False)
        self.head = nn.Linear(12, 8)
        self.n4 = nn.LayerNorm(8)
        self.out = nn.Linear(8, 4)
        with torch.no_grad():  # not the identity's γ = 1, β = 0
            for n in (self.n1, self.n2, self.n4):
                n.weight.normal_(1.0, 0.3)
                n.bias.normal_(0.0, 0.3)

    def forward(self, x):  # x [B, T=5, 6]
        h = torch.tanh(self.n1(self.a(x)))
        h = self.n3(self.n2(h)).mean(1)
        return self.out(torch.relu(self.n4(self.head(h))))


def _scaled_ws(model, scale):
    from dpcore.layers import WSConv2d

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, WSConv2d):
                m.weight.mul_(scale)
    return model


CASES = [
    ("mlp", lambda: build_model("mlp", (1, 8, 8), 10), (1, 8, 8), 10),
    ("ws_gn", ws_gn_net, (1, 8, 10), 5),
    # σ² ~ ε, so κ = σ²/(σ² + ε) is far from 1; gradients of ~1e3 then need float64 to be
    # compared at 1e-5.
    ("ws_gn_tiny_weights", lambda: _scaled_ws(ws_gn_net(), 3e-3).double(), (1, 8, 10), 5),
    ("resnet9", lambda: resnet9((3, 8, 8), 10, width=16), (3, 8, 8), 10),
    ("small_cnn", lambda: build_model("small_cnn", (1, 8, 8), 10), (1, 8, 8), 10),
    ("mnist_cnn", lambda: build_model("cnn", (1, 28, 28), 10), (1, 28, 28), 10),
    ("sequence", SeqModel, (5, 6), 4),
    ("layernorm", NormSeq, (5, 6), 4),
    ("conv_zoo", conv_zoo, (3, 9, 10), 5),
]


class TinyText(nn.Module):
    """Embedding → LayerNorm → Linear at every position → tanh → mean over positions → head.
    (Padding positions are not masked: their output gradients are not zero, and only
    nn.Embedding's padding_idx keeps them out of the table's gradient.)"""

    def __init__(self, vocab=40, dim=12, classes=3, padding_idx: int | None = 0):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.norm = nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        return self.head(torch.tanh(self.mix(self.norm(self.emb(x)))).mean(1))


def _reference(model, x, y, clip):
    return clipped_sum(PerSampleGradients(model, ce)(x, y), clip)


def _bk_optimizer(model, clip=0.01):
    return dpcore.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model=model,
        loss_fn=ce,
        noise_multiplier=1.0,
        clip_norm=clip,
        sample_rate=0.1,
        dataset_size=100,
        randomness=dpcore.SeededRandomness(0),
        ledger=dpcore.PrivacyLedger(None, 1e-5),
        clipping="bookkeeping",
        physical_batch_size=16,
    )
