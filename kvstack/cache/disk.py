"""The disk tier ("SSD"): saved sessions as content-addressed block files and a SQLite
manifest (design.md section 5). Standard library only, so that tools (and the kill tests)
can use it without torch.

    root/manifest.sqlite            sessions, blocks, and the prefix cache's blocks
    root/blocks/ab/abcd....blk      one stream block: the packed rows of every stream

It is also the lowest tier of the prefix cache: blocks the host tier pushes out are kept
here under their chain hash (which the model's fingerprint seeds), least recently used
first out when the budget is needed, and found again by later requests, in this process
or another.

A block file is named by the SHA-256 of its bytes, so its name is its checksum and equal
blocks are stored once. A session row holds the model's fingerprint, the format version,
the token ids and the names of its blocks, plus an HMAC-SHA-256 of all of those under the
directory's key (`manifest.key`): a flipped byte
in the manifest fails that session alone. Window rings are never saved: a resumed session
rebuilds them by replay.

Saving is atomic at every instant: block files are written to a temporary name, fsynced
and renamed (a kill leaves either no file or a whole one), then one SQLite transaction
swaps the session row, so a kill at any point leaves the old session or the new one.

Any number of processes and threads may share a directory; SQLite's write lock (BEGIN
IMMEDIATE, waited for) orders their changes. A save first pins every block it will name
(a `pins` row with its writer's host and pid, in one transaction), then writes the blocks
it lacks and rewrites any whose file is missing or does not match its name, then commits
the session row and drops its pins. Garbage collection runs under the write lock and
deletes only blocks no session, prefix entry or pin names, file and row together; pins of
writers that died are cleared when another opens the directory. Temporary files carry
their writer's name. Names read from the manifest are checked (64 hex digits) before they
become paths, and files are created 0600 in 0700 directories.
"""

import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

FORMAT_VERSION = 1  # the block payload layout and the manifest schema
MANIFEST = "manifest.sqlite"  # under the cache directory
KEY_FILE = "manifest.key"  # the key session rows are signed with (0600)

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    name TEXT PRIMARY KEY,
    model_fingerprint TEXT NOT NULL,
    format_version INTEGER NOT NULL,
    block_tokens INTEGER NOT NULL,
    held_tokens INTEGER NOT NULL,
    token_ids BLOB NOT NULL,
    blocks TEXT NOT NULL,
    window_ring_bytes INTEGER NOT NULL,
    saved_at REAL NOT NULL,
    checksum TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS blocks (
    hash TEXT PRIMARY KEY,
    nbytes INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS prefix_blocks (
    chain_hash TEXT PRIMARY KEY,
    block TEXT NOT NULL,
    used_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS prefix_blocks_by_block ON prefix_blocks (block);
CREATE TABLE IF NOT EXISTS pins (
    block TEXT NOT NULL,
    writer TEXT NOT NULL,
    PRIMARY KEY (block, writer)
);
"""

# Which session names which block, derived from sessions.blocks (which stays the checked
# record): it lets the garbage collector find unnamed blocks in SQL instead of reading
# every session's list and every file on each call. Built on first open of an older
# manifest.
SESSION_BLOCKS = """
CREATE TABLE session_blocks (
    session TEXT NOT NULL,
    block TEXT NOT NULL,
    PRIMARY KEY (session, block)
);
CREATE INDEX session_blocks_by_block ON session_blocks (block);
"""

UNNAMED_BLOCKS = """
SELECT hash FROM blocks
WHERE hash NOT IN (SELECT block FROM prefix_blocks)
  AND hash NOT IN (SELECT block FROM session_blocks)
  AND hash NOT IN (SELECT block FROM pins)
"""
log = logging.getLogger("kvstack")
BLOCK_NAME = re.compile(r"[0-9a-f]{64}")
BUSY_WAIT_S = 60  # how long a transaction waits for another writer's lock


@dataclass(frozen=True)
class SavedSession:
    name: str
    model_fingerprint: str
    format_version: int
    block_tokens: int
    held_tokens: int  # tokens whose stream entries the blocks hold
    token_ids: list[int]  # every token of the session (held ones first)
    blocks: list[str]  # block file names, in block-table order
    window_ring_bytes: int  # what saving the window rings too would have added
    saved_at: float
    disk_bytes: int  # of its block files (a block shared with another session counted)


def _token_blob(token_ids: list[int]) -> bytes:
    return b"".join(t.to_bytes(4, "little") for t in token_ids)


def _tokens_of(blob: bytes) -> list[int]:
    return [int.from_bytes(blob[i : i + 4], "little") for i in range(0, len(blob), 4)]


def _row_checksum(name: str, fingerprint: str, version: int, block_tokens: int, held: int,
                  token_blob: bytes, blocks_json: str, ring_bytes: int,
                  key: bytes | None = None) -> str:
    """SHA-256 of a session row's fields; with `key`, HMAC-SHA-256 under it."""
    digest = hmac.new(key, digestmod=hashlib.sha256) if key is not None else hashlib.sha256()
    for part in (name, fingerprint, str(version), str(block_tokens), str(held), blocks_json,
                 str(ring_bytes)):
        digest.update(part.encode() + b"\0")
    digest.update(token_blob)
    return digest.hexdigest()


class DiskTier:
    def __init__(self, root: str | Path, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"disk budget must be positive, got {budget_bytes}")
        self.root = Path(root).expanduser()
        self.budget_bytes = budget_bytes
        self.blocks_dir = self.root / "blocks"
        # Saved conversations are the user's own: 0700 directories, 0600 files.
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.blocks_dir.mkdir(mode=0o700, exist_ok=True)
        self.manifest = self.root / MANIFEST
        self._local = threading.local()
        fresh = not self.manifest.exists()
        self._db.executescript(SCHEMA)
        if fresh:
            os.chmod(self.manifest, 0o600)
        if self._db.execute("SELECT 1 FROM sqlite_master WHERE name = 'session_blocks'"
                            ).fetchone() is None:
            with self._transaction():
                for statement in SESSION_BLOCKS.split(";")[:-1]:
                    self._db.execute(statement)
                for name, blocks_json in self._db.execute(
                        "SELECT name, blocks FROM sessions").fetchall():
                    # A corrupt record names nothing: loading that session says so.
                    with contextlib.suppress(ValueError, TypeError):
                        self._name_blocks(name, json.loads(blocks_json))
        self._key = self._row_key()
        if fresh and next(self.blocks_dir.rglob("*.blk"), None) is not None:
            # Block files with no manifest: it was lost, not emptied. Nothing is swept, so
            # whoever restores it finds its sessions' blocks.
            log.warning("%s: block files without a manifest; left in place (restore %s, or "
                        "remove %s to reclaim them)", self.root, MANIFEST, self.blocks_dir)
        else:
            self._sweep_files()

    def _row_key(self) -> bytes:
        """The directory's key for session rows (32 random bytes, 0600), made on first open.
        Rows of a manifest written before there was a key that verify by plain SHA-256 are
        signed once, as the key is made; from then on only signed rows load, so a row forged
        by recomputing a bare SHA-256 (by whoever can write the manifest but not read the
        key file) is refused as corrupt. The key is made under the write lock and
        published by a rename after the rows it signed commit; a kill between leaves its
        temporary file, which the next open publishes."""
        path = self.root / KEY_FILE
        made = None
        with self._transaction():  # one process makes it; the others wait, then read it
            if not path.exists():
                pending = [p.read_bytes() for p in self.root.glob(f"{KEY_FILE}.*.tmp")]
                made = next((k for k in pending if len(k) == 32 and self._signed_by(k)),
                            None)
                if made is None:
                    made = os.urandom(32)
                    for row in self._db.execute("SELECT * FROM sessions").fetchall():
                        fields, checksum = row[:8], row[9]
                        if _row_checksum(*fields) == checksum:
                            self._db.execute("UPDATE sessions SET checksum = ? WHERE name = ?",
                                             (_row_checksum(*fields, key=made), row[0]))
                tmp = self.root / f"{KEY_FILE}.{self.writer.replace(':', '_')}.tmp"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(made)
                    f.flush()
                    os.fsync(f.fileno())
        if made is not None:
            os.replace(tmp, path)
            for stale in self.root.glob(f"{KEY_FILE}.*.tmp"):
                stale.unlink(missing_ok=True)
        key = path.read_bytes()
        if len(key) != 32:
            raise ValueError(f"{path}: not a session key (32 bytes); its sessions cannot be "
                             "verified")
        return key

    def _signed_by(self, key: bytes) -> bool:
        """Whether the manifest's rows were signed with `key` (or it has none)."""
        row = self._db.execute("SELECT * FROM sessions LIMIT 1").fetchone()
        return row is None or hmac.compare_digest(_row_checksum(*row[:8], key=key), row[9])

    @property
    def _db(self) -> sqlite3.Connection:
        """This thread's connection to the manifest (a SQLite connection may not cross
        threads; the engine's tiers and a server's request handlers run on several).
        Writers on other connections are waited for, not failed on."""
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.manifest, isolation_level=None, timeout=BUSY_WAIT_S)
            db.execute("PRAGMA synchronous=FULL")
            self._local.db = db
        return db

    def close(self) -> None:
        """Close this thread's connection (another thread's closes with its thread)."""
        self._db.close()
        self._local.db = None

    # ---- paths and sizes ---------------------------------------------------------------
    def block_path(self, name: str) -> Path:
        """The file of block `name`; a name that is not 64 hex digits (a damaged or forged
        manifest row) is refused before it becomes a path."""
        if not isinstance(name, str) or not BLOCK_NAME.fullmatch(name):
            raise ValueError(f"{self.manifest} names a block {str(name)[:80]!r}: not a block "
                             "name (64 hex digits); the manifest is damaged")
        return self.blocks_dir / name[:2] / f"{name}.blk"

    @property
    def writer(self) -> str:
        """This thread's name in pins and temporary files: host, process, thread."""
        return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"

    @property
    def used_bytes(self) -> int:
        """Bytes of the block files the manifest names."""
        return self._db.execute("SELECT COALESCE(SUM(nbytes), 0) FROM blocks").fetchone()[0]

    # ---- save --------------------------------------------------------------------------
    def save(self, name: str, model_fingerprint: str, block_tokens: int, held_tokens: int,
             token_ids: list[int], payloads: list[bytes], window_ring_bytes: int) -> None:
        """Write (or replace) session `name`; refused before anything is written when the
        new blocks would not fit the budget."""
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"session name {name!r}: use a non-empty name without '/'")
        blocks = dict(zip((hashlib.sha256(p).hexdigest() for p in payloads), payloads,
                          strict=True))
        names = [hashlib.sha256(p).hexdigest() for p in payloads]
        with self._pinned(set(blocks)):
            with self._transaction():
                new = {n: p for n, p in blocks.items() if not self._block_bytes(n)}
                needed = sum(len(p) for p in new.values())
                old = self._session_blocks(name)
                freed = sum(self._block_bytes(n) for n in old - set(blocks)
                            if not self._named_elsewhere(n, name))
            # The prefix cache's blocks give way to a session; never one this save pins.
            while (self.used_bytes - freed + needed > self.budget_bytes
                   and self._drop_oldest_prefix()):
                pass
            if self.used_bytes - freed + needed > self.budget_bytes:
                raise ValueError(
                    f"disk budget full: session {name!r} needs {needed:,} new bytes, "
                    f"{self.budget_bytes - self.used_bytes:,} of {self.budget_bytes:,} are "
                    f"free in {self.root}; remove sessions (kvstack session rm) or raise the "
                    "budget")
            try:
                for block_name, payload in blocks.items():
                    # A block already stored is trusted only if its file still matches its
                    # name: a damaged one is rewritten from the good bytes in memory.
                    if block_name in new or not self._intact(block_name):
                        self._write_block(block_name, payload)
            except OSError as e:
                raise OSError(e.errno, f"while saving session {name!r} in {self.root}: "
                                       f"{e.strerror or e}") from e
            blocks_json = json.dumps(names)
            token_blob = _token_blob(token_ids)
            checksum = _row_checksum(name, model_fingerprint, FORMAT_VERSION, block_tokens,
                                     held_tokens, token_blob, blocks_json, window_ring_bytes,
                                     self._key)
            with self._transaction():
                self._db.executemany("INSERT OR IGNORE INTO blocks VALUES (?, ?)",
                                     [(n, len(p)) for n, p in blocks.items()])
                self._db.execute(
                    "INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (name, model_fingerprint, FORMAT_VERSION, block_tokens, held_tokens,
                     token_blob, blocks_json, window_ring_bytes, time.time(), checksum))
                self._db.execute("DELETE FROM session_blocks WHERE session = ?", (name,))
                self._name_blocks(name, names)
        self._collect_garbage()

    @contextmanager
    def _pinned(self, blocks: set[str]) -> Iterator[None]:
        """Blocks no collector (in any process) deletes while the body runs: what a save
        relies on between looking them up and committing the row that names them."""
        writer = self.writer
        with self._transaction():
            self._db.executemany("INSERT OR IGNORE INTO pins VALUES (?, ?)",
                                 [(b, writer) for b in blocks])
        try:
            yield
        finally:
            with self._transaction():
                self._db.execute("DELETE FROM pins WHERE writer = ?", (writer,))

    def _intact(self, block: str) -> bool:
        try:
            return hashlib.sha256(self.block_path(block).read_bytes()).hexdigest() == block
        except FileNotFoundError:
            return False

    def _write_block(self, name: str, payload: bytes) -> None:
        path = self.block_path(name)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        # Two writers of one block never share a temporary file.
        tmp = path.with_name(f"{name}.{self.writer.replace(':', '_')}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a power cut
        finally:
            os.close(dir_fd)

    # ---- load --------------------------------------------------------------------------
    def load(self, name: str, model_fingerprint: str) -> tuple[SavedSession, list[bytes]]:
        """The session and its block payloads, every byte checked; a clear ValueError
        naming the session and the file when anything is off."""
        saved = self.show(name)
        if saved.format_version != FORMAT_VERSION:
            raise ValueError(f"session {name!r} was saved in format version "
                             f"{saved.format_version}; this kvstack reads version "
                             f"{FORMAT_VERSION}")
        if saved.model_fingerprint != model_fingerprint:
            raise ValueError(f"session {name!r} was saved by another model (fingerprint "
                             f"{saved.model_fingerprint[:12]}…, this model "
                             f"{model_fingerprint[:12]}…) or other cache formats")
        payloads = []
        for block_name in saved.blocks:
            path = self.block_path(block_name)
            try:
                payload = path.read_bytes()
            except OSError as e:
                raise ValueError(f"session {name!r}: block file {path} is missing ({e})") \
                    from None
            if hashlib.sha256(payload).hexdigest() != block_name:
                raise ValueError(f"session {name!r}: block file {path} is corrupt (its "
                                 "checksum does not match)")
            payloads.append(payload)
        return saved, payloads

    # ---- the prefix cache's tier -------------------------------------------------------
    def put_prefix(self, chain_hash: str, payload: bytes) -> bool:
        """Keep a prefix-cache block; the least recently used ones make room for it
        (saved sessions are never pushed out). False if it cannot fit."""
        name = hashlib.sha256(payload).hexdigest()
        with self._pinned({name}):
            known = self._block_bytes(name) > 0
            needed = 0 if known else len(payload)
            while (self.used_bytes + needed > self.budget_bytes
                   and self._drop_oldest_prefix()):
                pass
            if self.used_bytes + needed > self.budget_bytes:
                return False
            if not known or not self._intact(name):
                self._write_block(name, payload)
            with self._transaction():
                self._db.execute("INSERT OR IGNORE INTO blocks VALUES (?, ?)",
                                 (name, len(payload)))
                self._db.execute("INSERT OR REPLACE INTO prefix_blocks VALUES (?, ?, ?)",
                                 (chain_hash, name, time.time()))
        return True

    def take_prefix(self, chain_hash: str) -> bytes | None:
        """A prefix-cache block's payload, or None; a corrupt file is forgotten (for a
        cache, a miss) rather than used."""
        row = self._db.execute("SELECT block FROM prefix_blocks WHERE chain_hash = ?",
                               (chain_hash,)).fetchone()
        if row is None:
            return None
        try:
            payload = self.block_path(row[0]).read_bytes()
        except OSError:
            payload = b""
        if hashlib.sha256(payload).hexdigest() != row[0]:
            with self._transaction():
                self._db.execute("DELETE FROM prefix_blocks WHERE chain_hash = ?",
                                 (chain_hash,))
            self._collect_garbage()
            return None
        self._db.execute("UPDATE prefix_blocks SET used_at = ? WHERE chain_hash = ?",
                         (time.time(), chain_hash))
        return payload

    def has_prefix(self, chain_hash: str) -> bool:
        return self._db.execute("SELECT 1 FROM prefix_blocks WHERE chain_hash = ?",
                                (chain_hash,)).fetchone() is not None

    @property
    def prefix_bytes(self) -> int:
        return self._db.execute(
            "SELECT COALESCE(SUM(b.nbytes), 0) FROM prefix_blocks p JOIN blocks b "
            "ON p.block = b.hash").fetchone()[0]

    def show(self, name: str) -> SavedSession:
        row = self._db.execute("SELECT * FROM sessions WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise ValueError(f"no saved session {name!r} in {self.root}")
        (_, fingerprint, version, block_tokens, held, token_blob, blocks_json, ring_bytes,
         saved_at, checksum) = row
        if not hmac.compare_digest(
                _row_checksum(name, fingerprint, version, block_tokens, held, token_blob,
                              blocks_json, ring_bytes, self._key), checksum):
            raise ValueError(f"session {name!r}: its record in {self.manifest} is corrupt "
                             "(its checksum does not match)")
        blocks = json.loads(blocks_json)
        return SavedSession(name, fingerprint, version, block_tokens, held,
                            _tokens_of(token_blob), blocks, ring_bytes, saved_at,
                            sum(self._block_bytes(b) for b in set(blocks)))

    def names(self) -> list[str]:
        return [row[0] for row in self._db.execute("SELECT name FROM sessions ORDER BY name")]

    def remove(self, name: str) -> None:
        with self._transaction():
            gone = self._db.execute("DELETE FROM sessions WHERE name = ?", (name,)).rowcount
            self._db.execute("DELETE FROM session_blocks WHERE session = ?", (name,))
        if not gone:
            raise ValueError(f"no saved session {name!r} in {self.root}")
        self._collect_garbage()

    # ---- helpers -----------------------------------------------------------------------
    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """One write transaction: the write lock is waited for (BUSY_WAIT_S, then
        sqlite3.OperationalError "database is locked"); whatever fails inside it, the
        COMMIT included (a full disk, a lock held too long), is rolled back, so the lock
        is never kept and the next transaction starts clean."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
            raise

    def _name_blocks(self, session: str, blocks: list[str]) -> None:
        self._db.executemany("INSERT OR IGNORE INTO session_blocks VALUES (?, ?)",
                             [(session, b) for b in blocks])

    def _session_blocks(self, name: str) -> set[str]:
        return {row[0] for row in self._db.execute(
            "SELECT block FROM session_blocks WHERE session = ?", (name,))}

    def _named_elsewhere(self, block: str, session: str) -> bool:
        return self._db.execute(
            "SELECT 1 FROM session_blocks WHERE block = ? AND session != ? LIMIT 1",
            (block, session)).fetchone() is not None

    def _block_bytes(self, block: str) -> int:
        row = self._db.execute("SELECT nbytes FROM blocks WHERE hash = ?", (block,)).fetchone()
        return row[0] if row else 0

    def _drop_oldest_prefix(self) -> bool:
        """Forget the least recently used prefix-cache block; False if there is none."""
        oldest = self._db.execute("SELECT chain_hash FROM prefix_blocks "
                                  "ORDER BY used_at LIMIT 1").fetchone()
        if oldest is None:
            return False
        with self._transaction():
            self._db.execute("DELETE FROM prefix_blocks WHERE chain_hash = ?", oldest)
        self._collect_garbage()
        return True

    def _collect_garbage(self) -> None:
        """Drop the blocks no session, prefix entry or pin names, row and file together
        under the write lock (a save that finds the row gone writes the file anew, and
        cannot lose it to this collector)."""
        with self._transaction():
            # A row whose name is not a block name is left alone (and never a path), and
            # so is a block any session record names: session_blocks is only an index of
            # those records, and a damaged index must not delete what they need.
            unnamed = [row[0] for row in self._db.execute(UNNAMED_BLOCKS).fetchall()
                       if isinstance(row[0], str) and BLOCK_NAME.fullmatch(row[0])
                       and self._db.execute("SELECT 1 FROM sessions WHERE instr(blocks, ?)"
                                            " LIMIT 1", (row[0],)).fetchone() is None]
            self._db.executemany("DELETE FROM blocks WHERE hash = ?", [(b,) for b in unnamed])
            for block in unnamed:
                self.block_path(block).unlink(missing_ok=True)

    def _sweep_files(self) -> None:
        """At open: what killed writers left. Their pins go (writers on this host whose
        process is gone), then their temporary files, then block files no row and no pin
        names (written by a save that never committed) -- all under the write lock, so a
        live writer's files are never taken."""
        host = socket.gethostname()
        with self._transaction():
            dead = {w for (w,) in self._db.execute("SELECT DISTINCT writer FROM pins")
                    if _dead_writer(w, host)}
            self._db.executemany("DELETE FROM pins WHERE writer = ?", [(w,) for w in dead])
            for tmp in self.blocks_dir.rglob("*.tmp"):
                writer = tmp.name.split(".", 1)[1].removesuffix(".tmp").replace("_", ":")
                if writer == "tmp" or _dead_writer(writer, host):  # "tmp": an older kvstack's
                    tmp.unlink(missing_ok=True)
            known = {row[0] for row in self._db.execute(
                "SELECT hash FROM blocks UNION SELECT block FROM pins "
                "UNION SELECT block FROM prefix_blocks")}
            records = self._db.execute("SELECT blocks FROM sessions").fetchall()
            try:
                for (blocks_json,) in records:
                    known.update(json.loads(blocks_json))
            except (ValueError, TypeError):
                # A record that cannot be read might name any file: delete none.
                known = None
            for path in self.blocks_dir.rglob("*.blk") if known is not None else ():
                if path.stem not in known:
                    path.unlink(missing_ok=True)
        self._collect_garbage()


def _dead_writer(writer: str, host: str) -> bool:
    """Whether a writer named host:pid:thread is a process of this host that has ended (a
    writer of another host, or a name that is not one, is left alone)."""
    parts = writer.rsplit(":", 2)
    if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    return False
