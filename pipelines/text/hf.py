"""Pretrained Hugging Face encoders as sequence classifiers for DP fine-tuning (full or LoRA).

``load_classifier("hf:<local folder or hub name>", num_labels, ...)`` gives an
:class:`HFClassifier`, a module that maps a batch of token ids [B, T] (padded with the
tokenizer's pad id) to logits [B, num_labels], and the tokenizer. Three choices make it fit
per-example clipping:

* **Every input has the batch on dim 0.** The attention mask is built from the padding as a
  [B, 1, 1, T] mask (additive; DeBERTa's multiplicative, as it expects: an additive one would
  turn its embeddings into NaN), and BERT-family (DistilBERT too) and DeBERTa models get
  explicit position ids [B, T]. (Their default is one [1, T] row broadcast over the batch: the
  position table's output would then carry the whole batch's gradient, and book-keeping could
  not tell the examples apart.) The mask also keeps the forward free of data-dependent
  branches, so the vmap reference runs.
* **No dropout.** A dropout mask is random per call: the batched pass and the per-example
  reference would see different masks, and the first-batch check of book-keeping would
  (rightly) refuse it. It is common in DP fine-tuning to train without it.
* **float32 parameters**, whatever the checkpoint's dtype (per-example clipping needs them;
  bf16 autocast of the forward is a separate matter).

**Pooling** (``pooling``): how a text's token vectors become the one vector the new head reads.
``cls`` is the Hugging Face classifier's own (for BERT, the pretrained pooler on the [CLS]
token); ``mean`` is the mean of the last layer's vectors over the text's tokens (padding
excluded), read by the classifier's Linear layer, with the pooler frozen (it is unused).
``auto`` (the default) takes what a sentence-transformers folder declares in its
``1_Pooling/config.json``: ``mean`` where it says ``pooling_mode_mean_tokens``, else ``cls``.
It matters: all-MiniLM-L6-v2 was trained for mean-pooled sentence vectors, and on SpamAssassin
(ε=3, 33 steps of 512) a DP linear probe of its mean-pooled vectors reaches 90–91 % on
validation where one of its [CLS] pooler's output stays at 68–72 % (docs/text.md).

With ``lora_rank > 0``, peft's LoRA adapters are added to ``lora_targets`` (module names, e.g.
``query``, ``value``) and only they and the classification head are trainable; every other
weight is frozen, so only they get per-example gradients. Book-keeping handles the model's
trainable layers (Linear over sequences, Embedding, LayerNorm; a LoRA adapter is two Linear
layers) and is checked against vmap on the first batch like any model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dpcore import DPConfigError

PREFIX = "hf:"
# Model types whose default position ids are 0..T-1 (so passing them explicitly changes nothing).
ZERO_BASED_POSITIONS = ("bert", "distilbert", "electra", "albert", "deberta", "deberta-v2")
# Model types that multiply by their attention mask (1: the text's token, 0: padding) where the
# others add it (0, or the dtype's minimum): DeBERTa zeroes its padded embeddings with it.
KEEP_MASKS = ("deberta", "deberta-v2")
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer.model", "vocab.json")
POOLINGS = ("auto", "cls", "mean")
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "classifier_dropout": 0.0}


@dataclass(frozen=True)
class LoraOptions:
    rank: int = 0  # 0: full fine-tuning
    alpha: float | None = None  # default: 2 × rank
    targets: tuple[str, ...] = ("query", "value")


class HFClassifier(nn.Module):
    """A Hugging Face sequence classifier on token ids [B, T]; returns logits [B, num_labels]."""

    def __init__(self, model: nn.Module, pad_token_id: int, model_type: str, source: str, pooling: str = "cls"):
        super().__init__()
        if pooling not in POOLINGS[1:]:
            raise ValueError(f"pooling={pooling!r}: the classifier pools by 'cls' or 'mean'.")
        self.model = model
        self.pooling = pooling
        self.pad_token_id = int(pad_token_id)
        self.positions = model_type in ZERO_BASED_POSITIONS
        self.keep_mask = model_type in KEEP_MASKS
        self.token_types = bool(getattr(model.config, "type_vocab_size", 0))
        self.source = source

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        batch, length = ids.shape
        dtype = next(p for p in self.model.parameters()).dtype
        padding = ids == self.pad_token_id
        if self.keep_mask:
            mask = (~padding).to(dtype)
        else:
            mask = torch.zeros(ids.shape, dtype=dtype, device=ids.device).masked_fill(padding, torch.finfo(dtype).min)
        extra = {}
        if self.positions:
            # contiguous (not an expanded view): Opacus's ghost clipping reshapes the ids with view()
            extra["position_ids"] = torch.arange(length, device=ids.device).repeat(batch, 1)
        if self.token_types:
            extra["token_type_ids"] = torch.zeros_like(ids)
        extra["attention_mask"] = mask[:, None, None, :]
        if self.pooling == "cls":
            return self.model(input_ids=ids, **extra).logits
        hf = _unwrapped(self.model)
        states = getattr(hf, hf.base_model_prefix)(input_ids=ids, **extra)[0]
        keep = (~padding).to(states.dtype)[..., None]  # each text's own tokens: one example's vector uses only its row
        return hf.classifier((states * keep).sum(1) / keep.sum(1).clamp_min(1.0))


def is_hf(name: str) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def check_folder(path: Path) -> None:
    """A local model folder must hold a config, weights and a tokenizer: say which are missing."""
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any((path / f).is_file() for f in WEIGHT_FILES):
        missing.append(f"weights ({' or '.join(WEIGHT_FILES[::2])})")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        missing.append(f"a tokenizer ({' or '.join(TOKENIZER_FILES)})")
    if missing:
        raise DPConfigError(
            f"model folder {path} has no {', no '.join(missing)}. Point hf: to a folder saved with "
            "save_pretrained() for both the model and its tokenizer."
        )


def _where(name: str) -> str:
    """The local folder for ``hf:<name>``, or the hub name itself."""
    ref = name[len(PREFIX) :]
    if not ref:
        raise DPConfigError("model='hf:' needs a local folder or a Hugging Face Hub name after 'hf:'.")
    path = Path(os.path.expanduser(ref))
    if path.exists():
        if not path.is_dir():
            raise DPConfigError(f"model={name!r}: {path} is a file; give the folder that holds the model.")
        check_folder(path)
        return str(path)
    if ref.startswith((".", "/", "~")) or ref.count("/") > 1:
        raise DPConfigError(f"model={name!r}: the folder {path} does not exist.")
    return ref  # a hub name (needs a network)


def absolute(name: str) -> str:
    """``hf:<folder>`` with the folder made absolute where it exists here, else ``name`` as it
    is: Ray Train's workers run in a working folder of their own, where a relative path (or
    ``~``) would name nothing, and a missing folder would be taken for a hub name."""
    if not is_hf(name):
        return name
    path = Path(os.path.expanduser(name[len(PREFIX) :]))
    return f"{PREFIX}{os.path.abspath(path)}" if path.is_dir() else name


def load_tokenizer(name: str):
    """The tokenizer of ``hf:<folder or hub name>`` (public and fixed: tokenizing costs no privacy)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(_where(name))
    except OSError as e:
        raise DPConfigError(f"the tokenizer of model={name!r} could not be loaded: {str(e).splitlines()[0]}") from None
    if tokenizer.pad_token_id is None:
        raise DPConfigError(f"model={name!r}: its tokenizer has no padding token; batches of texts need one.")
    return tokenizer


HEAD_NAMES = ("classifier", "pre_classifier", "score")  # Hugging Face's sequence-classification heads


def is_head(name: str) -> bool:
    """Whether parameter ``name`` belongs to the classification head the classifier adds
    (``classifier`` for BERT-like encoders, ``pre_classifier`` too for DistilBERT, ``score``
    for decoder models), with or without peft's wrapping."""
    return any(part in HEAD_NAMES for part in name.split("."))


def _unwrapped(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (the model itself without one)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def declared_pooling(where: str) -> str | None:
    """The pooling a sentence-transformers model declares (``1_Pooling/config.json``, found
    through its ``modules.json``): ``mean``, ``cls``, another mode's name, or None (no declaration,
    or the hub model has no such file). A hub model that cannot be reached is an error: its
    declaration is unknown, and guessing would train a head the logged model may not match."""
    import json

    def read(file: str) -> str | None:
        path = Path(where) / file
        if path.is_file():
            return path.read_text()
        if Path(where).exists():
            return None
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import RemoteEntryNotFoundError

        try:  # a hub name
            return Path(hf_hub_download(where, file)).read_text()
        except RemoteEntryNotFoundError:  # the hub says the model has no such file: nothing declared
            return None
        except Exception as e:  # no network, offline and not cached, …
            raise DPConfigError(
                f"pooling='auto' reads the pooling that the hub model {where!r} declares ({file}), and it could not "
                f"be fetched ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Set pooling to 'cls' "
                f"or 'mean'."
            ) from None

    modules = read("modules.json")
    folder = next(
        (m.get("path") for m in json.loads(modules or "[]") if str(m.get("type", "")).endswith("models.Pooling")), None
    )
    config = read(f"{folder}/config.json") if folder else None
    if not config:
        return None
    modes = [k[len("pooling_mode_") :] for k, v in json.loads(config).items() if k.startswith("pooling_mode_") and v]
    if modes == ["mean_tokens"]:
        return "mean"
    if modes == ["cls_token"]:
        return "cls"
    return "+".join(modes) or None


def _pooling(model: nn.Module, requested: str, where: str, name: str) -> str:
    """The pooling ``requested`` ('auto' resolved), checked against the model's head."""
    if requested not in POOLINGS:
        raise DPConfigError(f"pooling={requested!r} is unknown; use one of {', '.join(POOLINGS)}.")
    pooling = requested
    if requested == "auto":
        pooling = "mean" if declared_pooling(where) == "mean" else "cls"
    if pooling == "mean":
        head = getattr(model, "classifier", None)
        hidden = getattr(model.config, "hidden_size", None)
        linear = isinstance(head, nn.Linear) and head.in_features == hidden
        if not linear or hasattr(model, "pre_classifier"):  # DistilBERT: a two-layer head on the first token
            if requested == "auto":
                return "cls"
            if head is None:
                found = next((h for h in HEAD_NAMES if hasattr(model, h)), None)
                shape = "no 'classifier' layer" + (f" (its head is {found!r})" if found else "")
            elif isinstance(head, nn.Linear) and not linear:
                shape = f"a classifier Linear({head.in_features}, …) that does not read the hidden size {hidden}"
            elif linear:
                shape = "a two-layer head (pre_classifier and classifier)"
            else:
                shape = f"a {type(head).__name__} classifier"
            raise DPConfigError(
                f"pooling='mean' needs a classification head that is one Linear layer on the hidden vectors "
                f"(BERT-family models); {name} has {shape}. Use pooling='cls'."
            )
    return pooling


def load_classifier(
    name: str, num_labels: int, lora: LoraOptions = LoraOptions(), pooling: str = "auto"
) -> tuple[HFClassifier, object]:
    """(the classifier, its tokenizer) for ``hf:<folder or hub name>``; see the module doc."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    where = _where(name)
    try:
        quiet = _Quiet()  # the head is new by design: transformers' load report and progress bar say so at length
        config = AutoConfig.from_pretrained(where, num_labels=num_labels)
        for key, value in NO_DROPOUT.items():
            if hasattr(config, key):
                setattr(config, key, value)
        with quiet:
            model = AutoModelForSequenceClassification.from_pretrained(where, config=config, dtype=torch.float32)
    except OSError as e:  # not on the hub, no network, or a broken folder
        raise DPConfigError(f"model={name!r} could not be loaded: {str(e).splitlines()[0]}") from None
    tokenizer = load_tokenizer(name)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    pooling = _pooling(model, pooling, where, name)
    unused = unused_poolers(model) if pooling == "mean" else []
    for module in unused:  # frozen: it gets no gradient and costs no noise
        for p in model.get_submodule(module).parameters():
            p.requires_grad_(False)
    if lora.rank:
        with _Quiet():
            model = add_lora(model, lora, name, exclude=unused)
    model.train()  # from_pretrained leaves it in eval mode; a new torch module is in train mode (dropout is off)
    return HFClassifier(model, tokenizer.pad_token_id, config.model_type, name, pooling), tokenizer


class _Quiet:
    """transformers' logging at errors only, and no progress bar, inside the block."""

    def __enter__(self):
        import warnings

        from transformers.utils import logging as hf_logging

        self.hf, self.level = hf_logging, hf_logging.get_verbosity()
        self.bar = hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.warnings = warnings.catch_warnings()
        self.warnings.__enter__()
        warnings.simplefilter("ignore", FutureWarning)

    def __exit__(self, *exc):
        self.warnings.__exit__(*exc)
        self.hf.set_verbosity(self.level)
        if self.bar:
            self.hf.enable_progress_bar()


def unused_poolers(model: nn.Module) -> list[str]:
    """The names of the model's pooler modules (BERT's ``bert.pooler``, DeBERTa's ``pooler``),
    which mean pooling does not use."""
    return [n for n, _ in model.named_modules() if n.rsplit(".", 1)[-1] == "pooler"]


def add_lora(model: nn.Module, lora: LoraOptions, name: str, exclude: list[str] = ()) -> nn.Module:
    """peft's LoRA adapters on ``lora.targets``, none inside the modules ``exclude`` (an unused
    pooler: an adapter there would train on noise alone); the base model frozen, the head
    trainable."""
    from peft import LoraConfig, TaskType, get_peft_model

    inside = tuple(f"{e}." for e in exclude)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    linear = sorted({n.rsplit(".", 1)[-1] for n in linears})
    unknown = [t for t in lora.targets if t not in linear]
    if unknown:
        raise DPConfigError(
            f"lora target modules {unknown} match no Linear layer of {name}; its Linear layers are named: "
            f"{', '.join(linear)}."
        )
    only_unused = [t for t in lora.targets if all(n.startswith(inside) for n in linears if n.rsplit(".", 1)[-1] == t)]
    if inside and only_unused:
        raise DPConfigError(
            f"lora target modules {only_unused} of {name} are only in its pooler ({', '.join(exclude)}), which "
            f"pooling='mean' does not use. Target other layers, or use pooling='cls'."
        )
    skipped = [n for n in linears if n.startswith(inside)] if inside else []
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha if lora.alpha is not None else 2 * lora.rank,
        target_modules=list(lora.targets),
        exclude_modules=skipped or None,
        lora_dropout=0.0,
        task_type=TaskType.SEQ_CLS,
    )
    return get_peft_model(model, config)


def random_token_texts(model: str, shape: tuple[int, ...], g) -> torch.Tensor:
    """Input canaries for a text model: texts of ``shape[1]`` tokens drawn uniformly from the
    tokenizer's ordinary (non-special) tokens, framed by its start and end tokens where it has
    them (as a tokenized text is): word salad, unlike any real text."""
    tok = load_tokenizer(model)
    special = set(tok.all_special_ids)
    ordinary = torch.tensor([i for i in range(len(tok)) if i not in special])
    x = ordinary[torch.randint(0, len(ordinary), shape, generator=g)]
    if tok.cls_token_id is not None and tok.sep_token_id is not None:
        x[:, 0], x[:, -1] = tok.cls_token_id, tok.sep_token_id
    return x
