"""The ledger's journal: an append-only JSON-lines file, each record fsynced before it counts.

A crash can tear only the last line (it came mid-write, before the append returned). The release
it describes was never used by rank 0; in sharded training ranks ≥ 1 already hold the reduced,
noised sum then (the record follows the reduce), but they can send nothing anywhere before the
next report, which waits for rank 0, so nothing that used it leaves. :meth:`Journal.read` drops
such a torn last line and cuts it from the file, so that the next record starts on a line of its
own; a bad line anywhere else means the file cannot be trusted, and is an error.
"""

from __future__ import annotations

import json
import os

from ..errors import DPConfigError


class Journal:
    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)

    def __repr__(self) -> str:
        return f"Journal({self.path!r})"

    def exists(self) -> bool:
        """True if the file holds at least one byte (a run's journal always has its header)."""
        return os.path.exists(self.path) and os.path.getsize(self.path) > 0

    def write(self, record: dict) -> None:
        """Append one record; it is on disk (flushed and fsynced) when this returns."""
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def read(self, repair: bool = True) -> list[dict]:
        """Every complete record, in order; a torn last line is dropped, and with ``repair`` cut
        from the file (only the journal's writer may: a reader would cut a line being written)."""
        with open(self.path, "rb") as f:
            raw = f.read()
        lines = raw.split(b"\n")
        if raw.endswith(b"\n"):
            lines = lines[:-1]
        records, good_bytes = [], 0
        for i, line in enumerate(lines):
            try:
                records.append(json.loads(line.decode("utf-8")))
            except (json.JSONDecodeError, UnicodeDecodeError):
                if i == len(lines) - 1 and not raw.endswith(b"\n"):
                    break  # a torn last line: the crash came mid-write (each record is written with its newline)
                # a whole line that does not parse (its newline was written: not torn) is damage, and
                # dropping it could drop a release (helper-29)
                raise DPConfigError(
                    f"ledger journal {self.path} is corrupt at line {i + 1}; it cannot be trusted."
                ) from None
            good_bytes += len(line) + 1
        if repair and good_bytes != len(raw):
            self._repair(good_bytes, len(raw))
        return records

    def _repair(self, good_bytes: int, size: int) -> None:
        """Cut a torn last line, or end a last line that lacks its newline."""
        with open(self.path, "r+b") as f:
            f.truncate(min(good_bytes, size))
            if good_bytes > size:
                f.seek(0, os.SEEK_END)
                f.write(b"\n")
            f.flush()
            os.fsync(f.fileno())
