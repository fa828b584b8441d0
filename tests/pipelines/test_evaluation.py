"""Evaluation on the held-out splits: no autograd graph (a text model's activations for a
batch of texts would take GiBs, as a LoRA run on SpamAssassin once did: 18 GiB), F1 of class 1
for two-class tasks against scikit-learn, chunked forwards, and the model's mode restored."""

from __future__ import annotations

import math

import pytest
import torch
from sklearn.metrics import f1_score
from torch import nn

from pipelines.config import TrainConfig
from pipelines.train.report import eval_batch, evaluate


class Recording(nn.Module):
    def __init__(self, d=5, classes=2):
        super().__init__()
        self.lin = nn.Linear(d, classes)
        self.grad_enabled: list[bool] = []
        self.sizes: list[int] = []

    def forward(self, x):
        self.grad_enabled.append(torch.is_grad_enabled())
        self.sizes.append(x.shape[0])
        return self.lin(x)


@pytest.mark.parametrize("classes", [2, 3])
def test_evaluate_builds_no_graph_and_gives_accuracy_loss_and_f1(classes):
    torch.manual_seed(0)
    model = Recording(classes=classes).train()
    x, y = torch.randn(1000, 5), torch.randint(0, classes, (1000,))
    acc, loss, f1 = evaluate(model, (x, y), batch=300)
    assert model.grad_enabled == [False] * 4 and model.sizes == [300, 300, 300, 100]
    assert model.training  # put back in the mode it was in
    with torch.no_grad():
        logits = model.lin(x)
    pred = logits.argmax(1)
    assert acc == pytest.approx(float((pred == y).float().mean()))
    assert loss == pytest.approx(float(nn.functional.cross_entropy(logits, y)), rel=1e-5)
    if classes == 2:
        assert f1 == pytest.approx(f1_score(y.numpy(), pred.numpy()))
    else:
        assert math.isnan(f1)


def test_the_evaluation_batch_follows_the_physical_batch():
    assert eval_batch(TrainConfig(physical_batch_size=64)) == 256
    assert eval_batch(TrainConfig(physical_batch_size=1024)) == 2048
