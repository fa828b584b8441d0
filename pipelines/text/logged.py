"""A fine-tuned text classifier as an MLflow model: texts in, labels out.

What the model folder holds (``text_model/`` among the MLflow model's artifacts):

* with LoRA, the **adapter only**: peft's ``adapter_model.safetensors`` and
  ``adapter_config.json`` (the LoRA matrices and the trained classification head), plus the
  base model's name (``hf:<folder or hub name>``, in ``text.json``); the base weights are public
  and are loaded from that name again;
* with full fine-tuning, every weight (``save_pretrained``);
* the tokenizer, and ``text.json``: the base model, the LoRA options, the pooling (as
  resolved), ``max_length``, the e-mail view and the class names, so that a text is prepared exactly as at ingest.

``mlflow.pyfunc.load_model(uri).predict(["Subject: ...", ...])`` (or a one-column DataFrame of
texts) returns each text's label and the probability of every class. The model is logged from
code (``pyfunc_model.py``): loading unpickles nothing, and needs this package
(``pip install dp-platform[text]``); a LoRA model also needs its base model's name to resolve (a
local folder that exists there, or a hub name where a network exists). The input example logged
with the model is a fixed public text, never one of the dataset's.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import mlflow
import torch

META = "text.json"
PUBLIC_EXAMPLE = ["Subject: A public example\n\nThis sentence is not from any dataset."]


def save_text_model(clf, tokenizer, folder: Path, meta: dict) -> None:
    """Write the adapter (LoRA) or all weights (full), the tokenizer and ``text.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    sub = "adapter" if meta["lora_rank"] else "model"
    clf.model.save_pretrained(folder / sub)  # a PeftModel saves its adapter and head only
    tokenizer.save_pretrained(folder / "tokenizer")
    (folder / META).write_text(json.dumps(meta, indent=2))


def load_text_model(folder: str | Path):
    """(the classifier in eval mode, its tokenizer, ``text.json``) from :func:`save_text_model`'s folder."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from .hf import HFClassifier, LoraOptions, _Quiet, load_classifier

    folder = Path(folder)
    meta = json.loads((folder / META).read_text())
    pooling = meta.get("pooling", "cls")  # models logged before pooling was an option used the model's own head
    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    with _Quiet():
        if meta["lora_rank"]:
            from peft import PeftModel

            base, _ = load_classifier(meta["base_model"], len(meta["classes"]), LoraOptions(0), pooling)
            model = PeftModel.from_pretrained(base.model, folder / "adapter")
        else:
            model = AutoModelForSequenceClassification.from_pretrained(folder / "model", dtype=torch.float32)
    clf = HFClassifier(model, tokenizer.pad_token_id, model.config.model_type, meta["base_model"], pooling)
    return clf.eval(), tokenizer, meta


def text_meta(cfg, manifest: dict) -> dict:
    source = manifest.get("source", {})
    return {
        "base_model": cfg.model,
        "lora_rank": int(cfg.lora_rank),
        "lora_alpha": cfg.lora().alpha if cfg.lora_rank else None,
        "lora_targets": list(cfg.lora().targets) if cfg.lora_rank else None,
        "max_length": int(source.get("max_length", cfg.max_length)),
        "email_view": source.get("email_view", "message"),
        "classes": list(source["classes"]),
    }


def _texts(model_input) -> list[str]:
    if hasattr(model_input, "columns"):  # a pandas DataFrame
        column = "text" if "text" in model_input.columns else model_input.columns[0]
        return [str(t) for t in model_input[column].tolist()]
    if isinstance(model_input, str):
        return [model_input]
    return [str(t) for t in model_input]


def predict_texts(clf, tokenizer, meta: dict, texts: list[str], batch: int = 64):
    """A DataFrame: each text's ``label`` (a class name) and ``p_<class>`` for every class."""
    import pandas as pd

    from .sources import email_text, encode

    texts = [email_text(t, meta["email_view"]) for t in texts]
    probs = []
    with torch.no_grad():
        for lo in range(0, len(texts), batch):
            enc = encode(tokenizer, texts[lo : lo + batch], meta["max_length"], return_tensors="pt")
            probs.append(torch.softmax(clf(enc["input_ids"]), dim=1))
    p = torch.cat(probs) if probs else torch.zeros(0, len(meta["classes"]))
    classes = meta["classes"]
    out = pd.DataFrame({f"p_{c}": p[:, k].numpy() for k, c in enumerate(classes)})
    out.insert(0, "label", [classes[k] for k in p.argmax(1).tolist()])
    return out


class TextClassifier(mlflow.pyfunc.PythonModel):
    """The pyfunc of a fine-tuned text classifier (see the module doc)."""

    def load_context(self, context):
        self.clf, self.tokenizer, self.meta = load_text_model(context.artifacts["text_model"])

    def predict(self, context, model_input, params=None):
        return predict_texts(self.clf, self.tokenizer, self.meta, _texts(model_input))


def log_text_model(clf, meta: dict, tags: dict):
    """Log the classifier as an MLflow pyfunc named ``model`` in the active run; returns its ModelInfo."""
    from mlflow.models import infer_signature

    from ..tracking.models import pinned
    from .hf import load_tokenizer

    tokenizer = load_tokenizer(meta["base_model"])
    meta = {**meta, "pooling": clf.pooling}  # as resolved ('auto' names no pooling)
    example = list(PUBLIC_EXAMPLE)
    was_training = clf.training
    clf.eval()
    try:
        output = predict_texts(clf, tokenizer, meta, PUBLIC_EXAMPLE)
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "text_model"
            save_text_model(clf, tokenizer, folder, meta)
            return mlflow.pyfunc.log_model(
                name="model",
                python_model=str(Path(__file__).with_name("pyfunc_model.py")),  # from code: nothing pickled
                artifacts={"text_model": str(folder)},
                signature=infer_signature(example, output),
                input_example=example,
                pip_requirements=pinned("torch", "transformers", "peft", "pandas"),
                tags=tags,
            )
    finally:
        clf.train(was_training)
