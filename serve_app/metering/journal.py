"""The usage a gateway replica has not yet written to the ledger, kept in files beside it.

A replica merges usage in memory and writes it in batches (``metering/ledger.py``). Memory
alone loses what a replica held when it is killed (the OOM killer, a SIGKILL, a crash), and
everything it queued while the database was down: usage of answers its clients already had.
So each record is also appended to this replica's journal, a file of JSON lines, before the
request's metering ends; a batch is sealed by renaming that file to the batch's id, and deleted
once the database confirms the batch. A replica that dies leaves its files behind, and any
other replica sharing the directory (its replacement, a neighbour) adopts them: it writes each
sealed batch under its own id (a batch already applied is refused by the book, so nothing is
counted twice) and the unsealed rest as a batch of its own, sealed first under a new id.

Who is alive is told by ``flock``: each replica holds an exclusive lock on its ``.lock`` file
for its whole life, and the kernel releases it when the process dies, however it dies. The
journal survives the process, not the machine: on a laptop that is the ledger's own disk; on a
cluster, the Ray pod's filesystem (a killed replica is restarted in the same pod).

Appending is one ``write`` to a file opened for appending: one system call per request, no
``fsync`` (the page cache outlives a killed process; a power cut is not what this is for). A
line torn by a full disk is skipped when read.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from serve_app.metering.book import UsageEntry

logger = logging.getLogger("ray.serve")

# While the database is down, the unsealed file is rewritten as the merged counts whenever it
# grows past this (and past four times the merged size): a disk bounded by tenants x days x
# models, as memory is, whatever the outage's length.
COMPACT_AT_BYTES = 1 << 20

Key = tuple[str, str, str, str]  # (tenant, day, model, counter)


class JournalError(Exception):
    """The journal's directory did not take a write; the usage is still queued in memory."""


@dataclass
class Orphan:
    """A dead replica's journal, locked by its adopter until every batch of it is written."""

    owner: str
    lock: BinaryIO
    batches: dict[str, list[UsageEntry]] = field(default_factory=dict)  # batch id → entries
    paths: dict[str, Path] = field(default_factory=dict)  # batch id → its file

    def written(self, batch_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.paths.pop(batch_id).unlink()
        del self.batches[batch_id]

    def release(self) -> None:
        """Every batch written: the dead replica's lock file goes too."""
        with contextlib.suppress(FileNotFoundError):
            Path(self.lock.name).unlink()
        self.lock.close()


class UsageJournal:
    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory).expanduser()
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.owner = uuid.uuid4().hex
        self._lock = open(self.directory / f"{self.owner}.lock", "wb")
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._log = self._open_log()
        self.size = 0  # bytes in the unsealed file
        self._compacted_size = 0

    @property
    def _log_path(self) -> Path:
        return self.directory / f"{self.owner}.log"

    def _batch_path(self, owner: str, batch_id: str) -> Path:
        return self.directory / f"{owner}.{batch_id}.batch"

    def _open_log(self) -> BinaryIO:
        return open(self._log_path, "ab", buffering=0)

    def _reopen(self) -> None:
        """A new unsealed file; where the directory takes none, the closed one stays and each
        append is a ``JournalError`` (the usage is in memory only), never the request's."""
        try:
            self._log = self._open_log()
        except OSError:
            pass

    # -- the replica's own journal -----------------------------------------------------------

    def append(self, tenant: str, day: str, model: str, counts: Mapping[str, int]) -> None:
        line = json.dumps([tenant, day, model, dict(counts)], separators=(",", ":")) + "\n"
        data = line.encode()
        try:
            written = self._log.write(data)
        except (OSError, ValueError) as exc:  # ValueError: a file that could not be reopened
            raise JournalError(f"usage journal {self._log_path}: {exc}") from exc
        self.size += written or 0
        if written != len(data):
            raise JournalError(f"usage journal {self._log_path}: a short write (a full disk?)")

    def seal(self, batch_id: str) -> None:
        """What was appended becomes batch ``batch_id`` (the batch the ledger is about to
        write, holding exactly those records); appends go to a new file from here."""
        self._log.close()
        self.size = self._compacted_size = 0
        try:
            self._log_path.rename(self._batch_path(self.owner, batch_id))
        except OSError as exc:
            # Left unsealed, its lines would be sealed again with the next batch: counted
            # twice. Emptied, they are in memory only, as they would be without a journal.
            with contextlib.suppress(OSError):
                self._log_path.write_bytes(b"")
            raise JournalError(f"usage journal {self._log_path}: {exc}") from exc
        finally:
            self._reopen()

    def confirmed(self, batch_id: str) -> None:
        """The database took the batch: its file is not needed (one left behind is refused
        by its id when adopted)."""
        with contextlib.suppress(OSError):
            self._batch_path(self.owner, batch_id).unlink()

    def should_compact(self) -> bool:
        return self.size > max(COMPACT_AT_BYTES, 4 * self._compacted_size)

    def compact(self, pending: Mapping[Key, int]) -> None:
        """Rewrite the unsealed file as ``pending`` (what it holds, merged), atomically."""
        rows: dict[tuple[str, str, str], dict[str, int]] = {}
        for (tenant, day, model, counter), value in pending.items():
            rows.setdefault((tenant, day, model), {})[counter] = value
        text = "".join(
            json.dumps([*row, counts], separators=(",", ":")) + "\n" for row, counts in rows.items()
        )
        temporary = self.directory / f"{self.owner}.log.tmp"
        try:
            temporary.write_bytes(text.encode())
            self._log.close()
            temporary.rename(self._log_path)
        except OSError as exc:
            raise JournalError(f"usage journal {self._log_path}: {exc}") from exc
        finally:
            if self._log.closed:
                self._reopen()
        self.size = self._compacted_size = len(text.encode())

    def close(self) -> None:
        """A clean end with nothing queued: no file is left behind for an adopter."""
        self._log.close()
        with contextlib.suppress(OSError):
            if self._log_path.stat().st_size == 0:
                self._log_path.unlink()
            if not any(p.suffix != ".lock" for p in self.directory.glob(f"{self.owner}.*")):
                Path(self._lock.name).unlink()
        self._lock.close()  # what is left (the database was down) is adopted by another

    # -- the dead's journals -----------------------------------------------------------------

    def orphans(self) -> Iterator[Orphan]:
        """The journals of replicas no longer alive, each locked for its adopter (another
        replica adopting at the same moment skips it)."""
        for lock_path in sorted(self.directory.glob("*.lock")):
            owner = lock_path.stem
            if owner == self.owner:
                continue
            try:
                lock = open(lock_path, "ab")
            except FileNotFoundError:
                continue  # adopted and released just now
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                continue  # alive, or being adopted
            yield self._read_orphan(Orphan(owner, lock))

    def _read_orphan(self, orphan: Orphan) -> Orphan:
        unsealed = self.directory / f"{orphan.owner}.log"
        with contextlib.suppress(FileNotFoundError):
            if unsealed.stat().st_size == 0:
                unsealed.unlink()
            else:
                # Sealed under a new id before a byte of it is written: an adopter that dies
                # mid-way leaves a batch the next one writes under that same id.
                unsealed.rename(self._batch_path(orphan.owner, uuid.uuid4().hex))
        (self.directory / f"{orphan.owner}.log.tmp").unlink(missing_ok=True)
        for path in self.directory.glob(f"{orphan.owner}.*.batch"):
            batch_id = path.name.split(".")[1]
            orphan.batches[batch_id] = read_entries(path)
            orphan.paths[batch_id] = path
        return orphan


def read_entries(path: Path) -> list[UsageEntry]:
    """A journal file's lines, merged; a line that does not parse (torn by a full disk or a
    power cut) is skipped, and said."""
    merged: dict[Key, int] = {}
    skipped = 0
    for line in path.read_bytes().splitlines():
        try:
            tenant, day, model, counts = json.loads(line)
            for counter, value in counts.items():
                if isinstance(value, int) and value > 0:
                    key = (str(tenant), str(day), str(model), str(counter))
                    merged[key] = merged.get(key, 0) + value
        except (ValueError, TypeError, AttributeError):
            skipped += 1
    if skipped:
        logger.warning("usage journal %s: %d unreadable line(s) skipped", path.name, skipped)
    return [UsageEntry(*key, value) for key, value in merged.items()]
