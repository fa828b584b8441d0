"""A fine-tuned text classifier in MLflow (issue J, must-show 7): with LoRA, the adapter only (its
matrices and the head), the base model's name and the tokenizer; with full fine-tuning, every
weight and the tokenizer. Loaded back with ``mlflow.pyfunc.load_model``, it prepares raw texts
as ingest did and predicts what the trained model predicts. Its input example is a fixed
public text, not one of the dataset's."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import mlflow
import pytest
import torch

from pipelines import tracking
from pipelines.text.hf import LoraOptions, load_classifier
from pipelines.text.logged import PUBLIC_EXAMPLE, predict_texts
from pipelines.text.sources import email_text

MAIL = [
    "From: a@b.c\nSubject: You WON a free cruise\n\nClick here to claim your prize!!!",
    "From: bob@example.org\nSubject: Re: minutes\n\nThe meeting moved to 3pm; agenda attached.",
    "Subject: cheap meds\nContent-Type: text/html\n\n<p>No prescription <b>needed</b></p>",
]


def _trained(folder, rank, pooling):
    """A classifier whose trainable weights are moved off their initial values (as training would)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        clf, tokenizer = load_classifier(f"hf:{folder}", 2, LoraOptions(rank), pooling)
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for p in clf.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return clf, tokenizer


@pytest.mark.parametrize(
    "rank, pooling", [(4, "cls"), (4, "mean"), (0, "auto")], ids=["lora-cls", "lora-mean", "full-mean"]
)
def test_a_text_classifier_is_logged_registered_and_loads_back(minilm_folder, tmp_path, rank, pooling):
    """Loaded back, it pools as it was trained to (the pooling, resolved, is in ``text.json``)."""
    clf, tokenizer = _trained(minilm_folder, rank, pooling)
    assert clf.pooling == ("mean" if pooling in ("auto", "mean") else "cls")
    meta = {
        "base_model": f"hf:{minilm_folder}",
        "lora_rank": rank,
        "lora_alpha": 8.0 if rank else None,
        "lora_targets": ["query", "value"] if rank else None,
        "max_length": 48,
        "email_view": "subject-body",
        "classes": ["ham", "spam"],
    }
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    client = mlflow.MlflowClient()
    experiment = client.create_experiment("t", artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = client.create_run(experiment).info.run_id
    version = tracking.log_model(run_id, clf, None, "dp-text-test", 2.5, 1e-5, "pld", text=meta)
    assert version is not None and version.tags["dp.epsilon"] == "2.5"

    expected = predict_texts(clf.eval(), tokenizer, meta, MAIL)
    (tmp_path / "pyfunc").mkdir()  # MLflow's default is a fresh folder under /tmp, never removed
    model = mlflow.pyfunc.load_model(f"models:/dp-text-test/{version.version}", dst_path=str(tmp_path / "pyfunc"))
    got = model.predict(MAIL)
    assert list(got["label"]) == list(expected["label"])
    torch.testing.assert_close(
        torch.tensor(got[["p_ham", "p_spam"]].to_numpy()), torch.tensor(expected[["p_ham", "p_spam"]].to_numpy())
    )
    import pandas as pd

    assert list(model.predict(pd.DataFrame({"message": MAIL}))["label"]) == list(expected["label"])

    local = Path(
        mlflow.artifacts.download_artifacts(f"models:/dp-text-test/{version.version}", dst_path=str(tmp_path / "dl"))
    )
    files = {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()}
    weights = {f for f in files if f.endswith(".safetensors")}
    if rank:  # the adapter alone: a few hundred KiB, no copy of the 22M base weights
        assert weights == {"artifacts/text_model/adapter/adapter_model.safetensors"}
        assert (local / "artifacts/text_model/adapter/adapter_model.safetensors").stat().st_size < 2**20
    else:
        assert weights == {"artifacts/text_model/model/model.safetensors"}
    assert "artifacts/text_model/tokenizer/tokenizer.json" in files
    saved = json.loads((local / "artifacts/text_model/text.json").read_text())
    assert saved["base_model"] == f"hf:{minilm_folder}" and saved["classes"] == ["ham", "spam"]
    assert saved["pooling"] == clf.pooling
    example = json.loads((local / "input_example.json").read_text())
    assert example == PUBLIC_EXAMPLE and not any(m in example or email_text(m, "subject-body") in example for m in MAIL)
