"""The replay log: the updates released since the last checkpoint, kept so that a crash costs no ε.

Each release is a noised, clipped lot gradient the ledger has already paid for; anything
computed from it is post-processing. The state at a crash is therefore a deterministic function
of the last checkpoint and the released updates since: keep them, and a restart replays them
instead of rolling them back (and paying for them again).

One segment file per checkpoint, ``segment-<checkpoint step>.bin``, holds the records of the
steps after that checkpoint:

* a header: ``MAGIC``, the JSON length (u32), the JSON (the run's identity, the checkpoint's
  step, the parameters' names, shapes and dtype) and its CRC-32;
* one record per release: ``b"R"``, the step (u64), the payload's length (u64), the payload
  (the released update: every parameter's gradient as the optimizer applied it, flattened and
  concatenated, float32), and the CRC-32 of step and payload (u32).

The checksum is there to find a record torn by a crash or corrupted on disk, not to resist an
adversary: CRC-32 finds every burst error up to 32 bits and any other with probability
1 − 2⁻³², at about 4× SHA-256's speed (4.7 ms against 20 ms for ResNet-9's 25 MiB, measured
here). Privacy never rests on it: a record that is lost or refused only means that its
release, which the ledger has counted, is rolled back instead of replayed.

:class:`ReplayWriter` writes records off the hot path: :meth:`ReplayWriter.append` hands the
released tensors (fresh ones at every release, never written again) to a thread that
checksums and writes them; on a GPU, one asynchronous copy to pinned host memory. Each record
is in the page cache when written, so a killed process (the usual crash: preemption, OOM, a
kill) loses only the records still queued; the file is fsynced at most once a second, so a lost
node loses at most about a second more. Either way those releases are rolled back and counted,
never replayed from a partial record.
:func:`read_segment` returns the intact prefix of a segment: a torn or corrupt record ends it,
and the releases after it stay counted as spent. A segment of another run is refused. Nothing
here releases anything: it only keeps what was released.
"""

from __future__ import annotations

import json
import mmap
import os
import queue
import struct
import threading
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

MAGIC = b"DPREPLAY1\n"
_HEAD = struct.Struct("<I")
_REC = struct.Struct("<cQQ")
_CRC = struct.Struct("<I")
_DIGEST = _CRC.size


def segment_path(folder: str | os.PathLike, after_step: int) -> Path:
    return Path(folder) / f"segment-{int(after_step):09d}.bin"


def layout_of(params: dict[str, torch.Tensor]) -> list:
    """The parameters' names and shapes, in order: what a record's payload is laid out as."""
    return [[name, list(p.shape)] for name, p in params.items()]


class ReplayLogRefused(Exception):
    """The segment belongs to another run, or to parameters of other names or shapes."""


@dataclass(frozen=True)
class Segment:
    """The intact prefix of one segment: its records' steps, where each payload lies, and what
    ended it (``None``: the file ended cleanly after its last record)."""

    path: Path
    after_step: int
    steps: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]  # (offset, length) of each payload
    ends: tuple[int, ...]  # the file offset just after each record
    header_end: int
    problem: str | None

    def payload(self, i: int) -> torch.Tensor:
        """Record ``i``'s released update, flat float32 (a fresh tensor)."""
        off, n = self.spans[i]
        with open(self.path, "rb") as f:
            f.seek(off)
            raw = bytearray(f.read(n))
        return torch.frombuffer(raw, dtype=torch.float32)


def _header_bytes(run: str, after_step: int, layout: list) -> bytes:
    meta = json.dumps({"run": run, "after_step": int(after_step), "layout": layout, "dtype": "float32"}).encode()
    return MAGIC + _HEAD.pack(len(meta)) + meta + _CRC.pack(zlib.crc32(meta))


def read_segment(path: str | os.PathLike, run: str, after_step: int, layout: list) -> Segment:
    """The intact, contiguous prefix of the segment at ``path``: records of steps
    ``after_step + 1, after_step + 2, …``, each with a matching checksum.

    Raises :class:`ReplayLogRefused` if its header names another run, checkpoint or parameter
    layout, and ``FileNotFoundError`` if there is no such file. A torn or corrupt record ends
    the prefix (``problem`` says where); it is never an error, because the releases it held
    stay counted as spent."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size == 0:
            return Segment(path, after_step, (), (), (), 0, "the file is empty")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m[: len(MAGIC)] != MAGIC or size < len(MAGIC) + _HEAD.size:
                raise ReplayLogRefused(f"{path} is not a replay log segment")
            (n,) = _HEAD.unpack_from(m, len(MAGIC))
            start = len(MAGIC) + _HEAD.size
            meta_raw = m[start : start + n]
            if _CRC.pack(zlib.crc32(meta_raw)) != m[start + n : start + n + _DIGEST]:
                raise ReplayLogRefused(f"the header of {path} is corrupt")
            meta = json.loads(meta_raw)
            if meta.get("run") != run:
                raise ReplayLogRefused(f"{path} belongs to run {meta.get('run')!r}, not to this run ({run!r})")
            if meta.get("after_step") != after_step or meta.get("layout") != layout:
                raise ReplayLogRefused(
                    f"{path} continues the checkpoint of step {meta.get('after_step')} with parameters "
                    f"{[n for n, _ in meta.get('layout', [])][:3]}…, not this run's checkpoint of step {after_step}"
                )
            header_end = pos = start + n + _DIGEST
            expected = 4 * sum(_numel(shape) for _, shape in layout)
            steps, spans, ends, problem = [], [], [], None
            while pos < size:
                if pos + _REC.size > size:
                    problem = f"a torn record at byte {pos}"
                    break
                tag, step, length = _REC.unpack_from(m, pos)
                body = pos + _REC.size
                if tag != b"R" or length != expected or body + length + _DIGEST > size:
                    problem = f"a torn or corrupt record at byte {pos}"
                    break
                crc = zlib.crc32(memoryview(m)[body : body + length], zlib.crc32(m[pos + 1 : pos + 9]))
                if _CRC.pack(crc) != m[body + length : body + length + _DIGEST]:
                    problem = f"the record of step {step} fails its checksum"
                    break
                if step != after_step + len(steps) + 1:
                    problem = f"a record of step {step} where step {after_step + len(steps) + 1} was due"
                    break
                steps.append(step)
                spans.append((body, length))
                pos = body + length + _DIGEST
                ends.append(pos)
    return Segment(path, after_step, tuple(steps), tuple(spans), tuple(ends), header_end, problem)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


class ReplayWriter:
    """Rank 0's writer of the replay log (see the module docstring).

    ``append(step, tensors)`` costs the hot path nothing but a queue entry (on a GPU, an
    asynchronous copy to pinned host memory): the tensors must be fresh ones that nothing writes
    again, as a release's are. A background thread checksums and writes them (fsyncing at most
    once a second). ``rotate(step)`` (after a checkpoint of ``step`` is complete) starts the next
    segment and deletes the older ones. If the disk fails, logging stops with one warning: training goes
    on, and a crash after that costs what it cost before the replay log (the releases since the
    checkpoint stay counted as spent).
    """

    SYNC_EVERY_S = 1.0  # fsync at most this often (and at every new segment, flush and close)

    def __init__(
        self, folder: str | os.PathLike, run: str, layout: list, after_step: int, keep_until: int | None = None
    ):
        self.folder, self.run, self.layout = Path(folder), run, layout
        self.folder.mkdir(parents=True, exist_ok=True)
        self.error: BaseException | None = None
        self.bytes_written = 0
        self._queue: queue.Queue = queue.Queue(maxsize=4)
        self._pinned: queue.SimpleQueue = queue.SimpleQueue()  # reused host buffers (GPU): pinning is slow
        self._file = None
        self._synced = time.monotonic()
        self._open(after_step, keep_until)
        self._thread = threading.Thread(target=self._run, name="dp-replay-log", daemon=True)
        self._thread.start()

    # -- on the training thread -------------------------------------------------------------
    def append(self, step: int, tensors: list[torch.Tensor]) -> None:
        if self.error is not None:
            return
        parts = [t.detach() for t in tensors]
        ready = None
        if any(t.is_cuda for t in parts):
            # no host sync in the step: copy to pinned memory, the writer waits for the copy
            flat = torch.cat([t.reshape(-1).to(torch.float32) for t in parts])
            try:
                host = self._pinned.get_nowait()
            except queue.Empty:
                host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            parts = [host]
        self._queue.put(("record", int(step), parts, ready))

    def rotate(self, after_step: int) -> None:
        """A checkpoint of ``after_step`` is complete: later records go to a new segment."""
        self._queue.put(("rotate", int(after_step), None, None))

    def flush(self) -> None:
        """Wait until every record handed over so far is on disk."""
        self._queue.join()
        if self._file is not None and not self._file.closed:
            os.fdatasync(self._file.fileno())

    def close(self, remove: bool = False) -> None:
        """Stop the writer; with ``remove``, delete the log (the final checkpoint holds everything)."""
        self._queue.put(("close", 0, None, None))
        self._thread.join()
        if remove:
            for p in self.folder.glob("segment-*.bin"):
                p.unlink(missing_ok=True)

    # -- on the writer thread ---------------------------------------------------------------
    def _open(self, after_step: int, keep_until: int | None) -> None:
        """Open the segment after checkpoint ``after_step``: a new one, or (``keep_until``) the
        existing one cut just after the record of step ``keep_until`` (what a restart replayed)."""
        if self._file is not None:
            self._file.close()
        path = segment_path(self.folder, after_step)
        self.current = {"path": path, "after_step": int(after_step)}
        if keep_until is not None and keep_until > after_step:
            seg = read_segment(path, self.run, after_step, self.layout)
            cut = seg.ends[keep_until - after_step - 1]
            self._file = open(path, "r+b")
            self._file.truncate(cut)
            self._file.seek(cut)
        else:
            self._file = open(path, "wb")
            self._file.write(_header_bytes(self.run, after_step, self.layout))
        self._file.flush()
        os.fsync(self._file.fileno())
        for old in self.folder.glob("segment-*.bin"):
            if old != path:
                old.unlink(missing_ok=True)

    def _run(self) -> None:
        while True:
            kind, step, flat, ready = self._queue.get()
            try:
                if kind == "close":
                    if self._file is not None:
                        self._file.close()
                    return
                if kind == "rotate":  # a fresh segment; logging resumes if it had stopped
                    self._open(step, None)
                    self.error = None
                    continue
                if self.error is not None:
                    continue
                if ready is not None:
                    ready.synchronize()
                views = [memoryview(t.contiguous().to(torch.float32).numpy()).cast("B") for t in flat]
                nbytes = sum(v.nbytes for v in views)
                head = _REC.pack(b"R", step, nbytes)
                crc = zlib.crc32(head[1:9])
                for v in views:
                    crc = zlib.crc32(v, crc)
                self._file.write(head)
                for v in views:
                    self._file.write(v)
                self._file.write(_CRC.pack(crc))
                self._file.flush()  # in the page cache: a killed process loses nothing from here
                if time.monotonic() - self._synced >= self.SYNC_EVERY_S:  # a lost node: at most a second more
                    os.fdatasync(self._file.fileno())
                    self._synced = time.monotonic()
                self.bytes_written += len(head) + nbytes + _DIGEST
                if ready is not None:
                    self._pinned.put(flat[0])  # written: the buffer can take another update
            except BaseException as e:  # never stop training: a later crash just costs the unlogged releases
                self.error = e
                warnings.warn(
                    f"the replay log stopped ({type(e).__name__}: {e}); releases from here to the next checkpoint "
                    "count as spent if the run crashes",
                    stacklevel=1,
                )
            finally:
                self._queue.task_done()
