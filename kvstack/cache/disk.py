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
in the manifest fails that session alone. A conversation with pictures also lists them
(`images`: where each segment starts, its patch grid, and the file of its patches, stored as
a block file is), which the signature covers: a replay over an image segment encodes the
picture again. Window rings are never saved: a resumed session
rebuilds them by replay.

Saving is atomic at every instant: block files are written to a temporary name, fsynced
and renamed (a kill leaves either no file or a whole one), then one SQLite transaction
swaps the session row, so a kill at any point leaves the old session or the new one.

Block files are deleted only on the word of a manifest that is this directory's: it holds
a `directory` row signed with the key. A manifest that is missing, empty, unreadable or
another directory's, beside block files, marks the directory orphaned (`ORPHANED`, a file
that persists across opens): while the mark stands no block file is deleted, whatever the
tables say, and opening or listing is safe any number of times. Restoring the manifest
from a backup brings its sessions back; the mark clears itself once the manifest is this
directory's and names every block file, or by `recover` (`kvstack session recover`), which
can also discard what no manifest will name again or trust a manifest whose key was lost.

Any number of processes and threads may share a directory; SQLite's write lock (BEGIN
IMMEDIATE, waited for) orders their changes. A save first pins every block it will name
(a `pins` row with its writer's host and pid, in one transaction), then writes the blocks
it lacks and rewrites any whose file is missing or does not match its name, then commits
the session row and drops its pins. Garbage collection runs under the write lock and
deletes only blocks no session, prefix entry or pin names, file and row together; pins of
writers that died are cleared when another opens the directory. Temporary files carry
their writer's name. Names read from the manifest are checked (64 hex digits) before they
become paths, and files are created 0600 in 0700 directories. Opens are serialised by an
advisory lock (`lock`), so concurrent first opens of a new directory make one manifest,
one key and one schema.
"""

import contextlib
import fcntl
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1  # the block payload layout and the manifest schema
MANIFEST = "manifest.sqlite"  # under the cache directory
KEY_FILE = "manifest.key"  # the key session rows are signed with (0600)
ORPHANED = "ORPHANED"  # present while no manifest may delete block files (its reason inside)
OPEN_LOCK = "lock"  # held while a process opens the directory

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
    checksum TEXT NOT NULL,
    images TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS blocks (
    hash TEXT PRIMARY KEY,
    nbytes INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS prefix_blocks (
    chain_hash TEXT PRIMARY KEY,
    block TEXT NOT NULL,
    used_at REAL NOT NULL,
    checksum TEXT
);
CREATE INDEX IF NOT EXISTS prefix_blocks_by_block ON prefix_blocks (block);
CREATE TABLE IF NOT EXISTS pins (
    block TEXT NOT NULL,
    writer TEXT NOT NULL,
    PRIMARY KEY (block, writer)
);
CREATE TABLE IF NOT EXISTS directory (
    id TEXT NOT NULL,
    signature TEXT NOT NULL
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
    # Its pictures: {"start", "n_vit_h", "n_vit_w", "ratio", "file"} each, the file holding
    # the patches (bf16 [n_vit_h n_vit_w, 3, p, p]).
    images: list[dict[str, Any]] = field(default_factory=list)


def _token_blob(token_ids: list[int]) -> bytes:
    return b"".join(t.to_bytes(4, "little") for t in token_ids)


def _tokens_of(blob: bytes) -> list[int]:
    return [int.from_bytes(blob[i : i + 4], "little") for i in range(0, len(blob), 4)]


def _row_checksum(name: str, fingerprint: str, version: int, block_tokens: int, held: int,
                  token_blob: bytes, blocks_json: str, ring_bytes: int,
                  key: bytes | None = None, images_json: str = "") -> str:
    """SHA-256 of a session row's fields; with `key`, HMAC-SHA-256 under it. The images
    field counts where it is not empty (rows without pictures sign as before it)."""
    digest = hmac.new(key, digestmod=hashlib.sha256) if key is not None else hashlib.sha256()
    for part in (name, fingerprint, str(version), str(block_tokens), str(held), blocks_json,
                 str(ring_bytes)):
        digest.update(part.encode() + b"\0")
    digest.update(token_blob)
    if images_json:
        digest.update(b"\0images\0" + images_json.encode())
    return digest.hexdigest()


def _files_of(blocks_json: Any, images_json: Any) -> list[str]:
    """Every file a session row names, its blocks and its pictures (as far as a damaged
    row can be read)."""
    files: list[str] = []
    with contextlib.suppress(ValueError, TypeError):
        files += [b for b in json.loads(blocks_json) if isinstance(b, str)]
    with contextlib.suppress(ValueError, TypeError):
        if images_json:
            files += [i["file"] for i in json.loads(images_json)
                      if isinstance(i, dict) and isinstance(i.get("file"), str)]
    return files


_IMAGE_KEYS = {"start": int, "n_vit_h": int, "n_vit_w": int, "ratio": int, "file": str}


def _images_of(images_json: str) -> list[dict[str, Any]] | None:
    """A row's picture list (None: damaged)."""
    if not images_json:
        return []
    try:
        images = json.loads(images_json)
    except ValueError:
        return None
    if not isinstance(images, list) or not all(
            isinstance(i, dict) and set(i) == set(_IMAGE_KEYS)
            and all(isinstance(i[k], t) for k, t in _IMAGE_KEYS.items())
            and BLOCK_NAME.fullmatch(i["file"]) for i in images):
        return None
    return images


@dataclass(frozen=True)
class DamagedSession:
    """A session row that cannot be trusted: listed as such, never loaded."""
    name: str
    reason: str


class DiskTier:
    def __init__(self, root: str | Path, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"disk budget must be positive, got {budget_bytes}")
        self.root = Path(root).expanduser()
        self.budget_bytes = budget_bytes
        self.blocks_dir = self.root / "blocks"
        # Saved conversations are the user's own: 0700 directories, 0600 files (a
        # directory an older kvstack made readable to others is closed on open).
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.blocks_dir.mkdir(mode=0o700, exist_ok=True)
        for path in (self.root, self.blocks_dir):
            _owner_only(path, 0o700)
        self.manifest = self.root / MANIFEST
        self._local = threading.local()
        with _open_lock(self.root):
            try:
                self._open()
            except sqlite3.DatabaseError as e:
                self._mark_orphaned(f"{MANIFEST} could not be read ({e})")
                self.close()
                raise ValueError(
                    f"{self.manifest} cannot be read ({e}). No block file was deleted, and "
                    f"none will be while {self.root / ORPHANED} stands: restore the manifest "
                    f"from a backup (or move it aside to start afresh), then run `kvstack "
                    f"session recover --cache-dir {self.root}`") from None

    def _open(self) -> None:
        """Schema, key and verdict, under the open lock: see the module's docstring."""
        self._db.executescript(SCHEMA)
        _owner_only(self.manifest, 0o600)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(prefix_blocks)")}
        if "checksum" not in columns:  # a manifest from before prefix rows were signed
            self._db.execute("ALTER TABLE prefix_blocks ADD COLUMN checksum TEXT")
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(sessions)")}
        if "images" not in columns:  # a manifest from before sessions held pictures
            self._db.execute("ALTER TABLE sessions ADD COLUMN images TEXT NOT NULL "
                             "DEFAULT ''")
        if self._db.execute("SELECT 1 FROM sqlite_master WHERE name = 'session_blocks'"
                            ).fetchone() is None:
            with self._transaction():
                for statement in SESSION_BLOCKS.split(";")[:-1]:
                    self._db.execute(statement)
                for name, blocks_json, images_json in self._db.execute(
                        "SELECT name, blocks, images FROM sessions").fetchall():
                    # A corrupt record names nothing: loading that session says so.
                    with contextlib.suppress(ValueError, TypeError, sqlite3.Error):
                        self._name_blocks(name, _files_of(blocks_json, images_json))
        verdict = self._take_key()
        if verdict is not None:
            self._mark_orphaned(verdict)
        if self.orphaned is not None:
            self._clear_mark_if_whole()
        if self.orphaned is not None:
            log.warning("%s is orphaned (%s): no block file is deleted until `kvstack session "
                        "recover --cache-dir %s`", self.root, self.orphaned, self.root)
        else:
            self._sweep_files()

    def _take_key(self) -> str | None:
        """Read the directory's key (32 random bytes, 0600), or make it on first open; the
        reason this manifest may not delete block files, or None.

        A manifest is this directory's when its `directory` row is signed with the key. A
        manifest from before that row was written is adopted when there are no block files
        to lose or one of its session rows verifies. Rows of a manifest from before there
        was a key that verify by plain SHA-256 are signed once, as the key is made; from
        then on only signed rows load, so a row forged by recomputing a bare SHA-256 is
        refused as corrupt. A lost key is never remade that way: a new key signs nothing
        old, so every old row is refused and the directory is marked orphaned. The key is
        made under the write lock and published by a rename after what it signed commits;
        a kill between leaves its temporary file, which the next open publishes."""
        path = self.root / KEY_FILE
        made, verdict = None, None
        with self._transaction():
            stamp = self._db.execute("SELECT id, signature FROM directory").fetchone()
            if not path.exists():
                pending = [p.read_bytes() for p in self.root.glob(f"{KEY_FILE}.*.tmp")]
                made = next((k for k in pending if len(k) == 32 and stamp is not None
                             and self._stamp_verifies(stamp, k)), None)
                if made is None:
                    made = os.urandom(32)
                    if stamp is None:
                        self._sign_legacy_rows(made)
                    else:
                        verdict = (f"{KEY_FILE} was lost: a new key was made, and the "
                                   "sessions signed with the old one are refused until "
                                   "it is restored")
                key = made
            else:
                key = path.read_bytes()
                if len(key) != 32:
                    raise ValueError(f"{path}: not a session key (32 bytes); its sessions "
                                     "cannot be verified")
            if stamp is None:
                if self._has_block_files() and not self._any_row_verifies(key):
                    verdict = (f"{MANIFEST} is new, empty or another directory's, and "
                               "names none of the block files beside it")
                directory = os.urandom(16).hex()
                self._db.execute("INSERT INTO directory VALUES (?, ?)",
                                 (directory, _stamp_signature(directory, key)))
            elif verdict is None and not self._stamp_verifies(stamp, key):
                verdict = (f"{MANIFEST} is signed with another key than {KEY_FILE} "
                           "(another directory's manifest, or a replaced key)")
            if made is not None:
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
        self._key = key
        return verdict

    def _sign_legacy_rows(self, key: bytes) -> None:
        for row in self._db.execute("SELECT rowid, * FROM sessions").fetchall():
            fields, checksum, images = row[1:9], row[10], row[11]
            with contextlib.suppress(TypeError, ValueError, AttributeError):
                if _row_checksum(*fields, images_json=images) == checksum:
                    self._db.execute("UPDATE sessions SET checksum = ? WHERE rowid = ?",
                                     (_row_checksum(*fields, key=key, images_json=images),
                                      row[0]))

    def _any_row_verifies(self, key: bytes) -> bool:
        for row in self._db.execute("SELECT * FROM sessions"):
            with contextlib.suppress(TypeError, ValueError, AttributeError):
                if hmac.compare_digest(_row_checksum(*row[:8], key=key, images_json=row[10]),
                                       row[9]):
                    return True
        return False

    @staticmethod
    def _stamp_verifies(stamp: tuple, key: bytes) -> bool:
        directory, signature = stamp
        return (isinstance(directory, str) and isinstance(signature, str)
                and hmac.compare_digest(_stamp_signature(directory, key), signature))

    def _has_block_files(self) -> bool:
        return next(self.blocks_dir.rglob("*.blk"), None) is not None

    # ---- the orphan mark ---------------------------------------------------------------
    @property
    def orphaned(self) -> str | None:
        """Why no block file may be deleted here, or None when the manifest may."""
        try:
            return (self.root / ORPHANED).read_text(errors="replace").strip() or "orphaned"
        except FileNotFoundError:
            return None

    def _mark_orphaned(self, reason: str) -> None:
        if self.orphaned is not None:
            return
        tmp = self.root / f"{ORPHANED}.{self.writer.replace(':', '_')}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{reason}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / ORPHANED)
        log.warning("%s: %s; no block file will be deleted until `kvstack session recover`",
                    self.root, reason)

    def _unnamed_files(self) -> list[Path]:
        """Block files no session record, prefix row or pin names."""
        named = {row[0] for row in self._db.execute(
            "SELECT block FROM prefix_blocks UNION SELECT block FROM pins")}
        for row in self._db.execute("SELECT blocks, images FROM sessions").fetchall():
            named.update(_files_of(*row))
        return [p for p in self.blocks_dir.rglob("*.blk") if p.stem not in named]

    def _clear_mark_if_whole(self) -> None:
        """A manifest restored whole (this directory's, naming every block file) lifts the
        mark by itself: sweeping then deletes nothing it did not name."""
        stamp = self._db.execute("SELECT id, signature FROM directory").fetchone()
        if stamp is not None and self._stamp_verifies(stamp, self._key) \
                and not self._unnamed_files():
            (self.root / ORPHANED).unlink(missing_ok=True)
            log.warning("%s: the manifest names every block file again; no longer orphaned",
                        self.root)

    def recover(self, discard: bool = False, resign: bool = False) -> dict[str, Any]:
        """Lift the orphan mark. The manifest in place (a restored backup, or the one made
        after a loss) must be this directory's -- or, with `resign`, it is trusted and its
        rows signed with this directory's key (for a lost key: without it a forged row
        cannot be told from a true one, so that is the operator's call). Block files no
        session names are kept unless `discard` deletes them. The block rows of restored
        sessions are rebuilt from their files. A report of what was found and done."""
        with _open_lock(self.root), self._transaction():
            stamp = self._db.execute("SELECT id, signature FROM directory").fetchone()
            if stamp is None or not self._stamp_verifies(stamp, self._key):
                if not resign:
                    raise ValueError(
                        f"{self.manifest} is not signed with {self.root / KEY_FILE}: "
                        "restore both from one backup, or pass --resign to trust this "
                        "manifest's rows and sign them with the current key")
                self._resign(self._key)
            restored = 0
            for row in self._db.execute("SELECT blocks, images FROM sessions").fetchall():
                for block in _files_of(*row):
                    if (BLOCK_NAME.fullmatch(block) and not self._block_bytes(block)
                            and self._intact(block)):
                        self._db.execute("INSERT OR IGNORE INTO blocks VALUES (?, ?)",
                                         (block, self.block_path(block).stat().st_size))
                        restored += 1
            unnamed = self._unnamed_files()
            if unnamed and not discard:
                raise ValueError(
                    f"{len(unnamed)} block files ({sum(p.stat().st_size for p in unnamed):,} "
                    f"bytes) in {self.blocks_dir} are named by no session of {self.manifest}:"
                    " restore the manifest that names them, or pass --discard to delete them")
            listing = self.sessions()
        (self.root / ORPHANED).unlink(missing_ok=True)
        self._sweep_files()
        return {"sessions": sum(isinstance(s, SavedSession) for s in listing),
                "damaged_sessions": [s.name for s in listing if isinstance(s, DamagedSession)],
                "block_rows_restored": restored, "files_discarded": len(unnamed)}

    def _resign(self, key: bytes) -> None:
        self._db.execute("DELETE FROM directory")
        directory = os.urandom(16).hex()
        self._db.execute("INSERT INTO directory VALUES (?, ?)",
                         (directory, _stamp_signature(directory, key)))
        for row in self._db.execute("SELECT rowid, * FROM sessions").fetchall():
            with contextlib.suppress(TypeError, ValueError, AttributeError):
                self._db.execute("UPDATE sessions SET checksum = ? WHERE rowid = ?",
                                 (_row_checksum(*row[1:9], key=key, images_json=row[11]),
                                  row[0]))
        self._db.execute("DELETE FROM prefix_blocks")  # a cache: nothing to vouch for

    @property
    def _db(self) -> sqlite3.Connection:
        """This thread's connection to the manifest (a SQLite connection may not cross
        threads; the engine's tiers and a server's request handlers run on several).
        Writers on other connections are waited for, not failed on."""
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.manifest, isolation_level=None, timeout=BUSY_WAIT_S)
            # A text field that is not UTF-8 (a damaged row) is read, not raised on: its
            # row then fails its checksum, and the rest of the manifest stays readable.
            db.text_factory = lambda b: b.decode("utf-8", "surrogateescape")
            db.execute("PRAGMA synchronous=FULL")
            self._local.db = db
        return db

    def close(self) -> None:
        """Close this thread's connection (another thread's closes with its thread)."""
        db, self._local.db = getattr(self._local, "db", None), None
        if db is not None:
            db.close()

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
             token_ids: list[int], payloads: list[bytes], window_ring_bytes: int,
             images: list[tuple[dict[str, Any], bytes]] = ()) -> None:
        """Write (or replace) session `name`; refused before anything is written when the
        new blocks would not fit the budget. `images`: each picture's place and grid, and
        its patches' bytes."""
        check_session_name(name)
        pictures = [(meta | {"file": hashlib.sha256(data).hexdigest()}, data)
                    for meta, data in images]
        stored = [*payloads, *(data for _, data in pictures)]
        blocks = dict(zip((hashlib.sha256(p).hexdigest() for p in stored), stored,
                          strict=True))
        names = [hashlib.sha256(p).hexdigest() for p in payloads]
        images_json = json.dumps([meta for meta, _ in pictures]) if pictures else ""
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
                                     self._key, images_json)
            with self._transaction():
                self._db.executemany("INSERT OR IGNORE INTO blocks VALUES (?, ?)",
                                     [(n, len(p)) for n, p in blocks.items()])
                self._db.execute(
                    "INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (name, model_fingerprint, FORMAT_VERSION, block_tokens, held_tokens,
                     token_blob, blocks_json, window_ring_bytes, time.time(), checksum,
                     images_json))
                self._db.execute("DELETE FROM session_blocks WHERE session = ?", (name,))
                self._name_blocks(name, list(blocks))
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
    def load(self, name: str, model_fingerprint: str,
             spare: Callable[[SavedSession, int], bytes | None] | None = None,
             ) -> tuple[SavedSession, list[bytes]]:
        """The session and its block payloads, every byte checked; a clear ValueError
        naming the session and the file when anything is off. A block file that is missing
        or damaged is rewritten from `spare(saved, index)` (the bytes another tier still
        holds of that block) when those bytes are the very ones the session names, so
        blocks shared between sessions heal instead of failing each of them."""
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
        for index, block_name in enumerate(saved.blocks):
            path = self.block_path(block_name)
            try:
                payload = path.read_bytes()
                damage = ("is corrupt (its checksum does not match)"
                          if hashlib.sha256(payload).hexdigest() != block_name else None)
            except OSError as e:
                damage = f"is missing ({e})"
            if damage is not None:
                payload = self._repair(saved, index, spare)
                if payload is None:
                    raise ValueError(f"session {name!r}: block file {path} {damage}")
                log.warning("session %r: block file %s %s; rewritten from the copy another "
                            "tier holds", name, path, damage)
            payloads.append(payload)
        return saved, payloads

    def load_images(self, saved: SavedSession) -> list[bytes]:
        """The patches' bytes of each of a saved session's pictures, checked; a clear
        ValueError naming the file when one is missing or damaged."""
        out = []
        for image in saved.images:
            path = self.block_path(image["file"])
            try:
                data = path.read_bytes()
            except OSError as e:
                raise ValueError(f"session {saved.name!r}: picture file {path} is missing "
                                 f"({e.strerror})") from None
            if hashlib.sha256(data).hexdigest() != image["file"]:
                raise ValueError(f"session {saved.name!r}: picture file {path} is corrupt "
                                 "(its checksum does not match)")
            out.append(data)
        return out

    def _repair(self, saved: SavedSession, index: int,
                spare: Callable[[SavedSession, int], bytes | None] | None) -> bytes | None:
        """The good bytes of a saved session's damaged block, written back to its file; None
        when no tier holds exactly those bytes."""
        block_name = saved.blocks[index]
        payload = spare(saved, index) if spare is not None else None
        if payload is None or hashlib.sha256(payload).hexdigest() != block_name:
            return None
        with self._pinned({block_name}):
            self._write_block(block_name, payload)
        return payload

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
                self._db.execute("INSERT OR REPLACE INTO prefix_blocks VALUES (?, ?, ?, ?)",
                                 (chain_hash, name, time.time(),
                                  _prefix_checksum(chain_hash, name, self._key)))
        return True

    def take_prefix(self, chain_hash: str) -> bytes | None:
        """A prefix-cache block's payload, or None. A row that is not signed, names no
        block, or whose file is gone or corrupt is forgotten and logged (for a cache, a
        miss) rather than used or raised into the request that reached it."""
        row = self._db.execute("SELECT block, checksum FROM prefix_blocks WHERE chain_hash = ?",
                               (chain_hash,)).fetchone()
        if row is None:
            return None
        block, checksum = row
        payload, why = None, None
        if not (isinstance(block, str) and BLOCK_NAME.fullmatch(block)
                and isinstance(checksum, str) and hmac.compare_digest(
                    _prefix_checksum(chain_hash, block, self._key), checksum)):
            why = "its row is damaged or unsigned"
        else:
            try:
                payload = self.block_path(block).read_bytes()
            except OSError as e:
                why = f"its block file cannot be read ({e.strerror or e})"
            else:
                if hashlib.sha256(payload).hexdigest() != block:
                    payload, why = None, f"its block file {self.block_path(block)} is corrupt"
        if why is not None:
            log.warning("%s: prefix-cache entry %s dropped: %s", self.manifest,
                        chain_hash[:16], why)
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
        where, param = _name_is(name)
        row = self._db.execute(f"SELECT * FROM sessions WHERE {where}", param).fetchone()
        if row is None:
            raise ValueError(f"no saved session {name!r} in {self.root}")
        saved = self._decode(row, self._block_sizes(name))
        if isinstance(saved, DamagedSession):
            raise ValueError(f"session {name!r}: {saved.reason}")
        return saved

    def sessions(self) -> list["SavedSession | DamagedSession"]:
        """Every session row, by name, decoded defensively: a row that cannot be trusted is
        a DamagedSession beside the intact ones. One pass over the manifest."""
        sizes: dict[str, int] = {}
        for session, nbytes in self._db.execute(
                "SELECT s.session, SUM(b.nbytes) FROM session_blocks s JOIN blocks b "
                "ON s.block = b.hash GROUP BY s.session"):
            sizes[session] = nbytes
        return [self._decode(row, sizes.get(row[0], 0))
                for row in self._db.execute("SELECT * FROM sessions ORDER BY name")]

    def _decode(self, row: tuple, disk_bytes: int) -> "SavedSession | DamagedSession":
        """A session row checked field by field (types, signature, block names)."""
        (name, fingerprint, version, block_tokens, held, token_blob, blocks_json, ring_bytes,
         saved_at, checksum, images_json) = row
        shown = str(name)
        types = ((name, str), (fingerprint, str), (version, int), (block_tokens, int),
                 (held, int), (token_blob, bytes), (blocks_json, str), (ring_bytes, int),
                 (saved_at, (int, float)), (checksum, str), (images_json, str))
        if any(not isinstance(value, kind) for value, kind in types):
            return DamagedSession(shown, f"its record in {self.manifest} is corrupt (a field "
                                         "has the wrong type)")
        try:
            expected = _row_checksum(name, fingerprint, version, block_tokens, held,
                                     token_blob, blocks_json, ring_bytes, self._key,
                                     images_json)
        except UnicodeEncodeError:  # a text field that was not UTF-8 when read
            expected = ""
        if not hmac.compare_digest(expected, checksum):
            return DamagedSession(shown, f"its record in {self.manifest} is corrupt (its "
                                         "checksum does not match)")
        try:
            blocks = json.loads(blocks_json)
        except ValueError:
            blocks = None
        if not isinstance(blocks, list):
            return DamagedSession(shown, f"its record in {self.manifest} holds no block list")
        bad = next((b for b in blocks if not (isinstance(b, str) and BLOCK_NAME.fullmatch(b))),
                   None)
        if bad is not None:
            return DamagedSession(shown, f"its record in {self.manifest} names {str(bad)[:80]!r}"
                                         ": not a block name (64 hex digits)")
        images = _images_of(images_json)
        if images is None:
            return DamagedSession(shown, f"its record in {self.manifest} holds a damaged "
                                         "image list")
        return SavedSession(name, fingerprint, version, block_tokens, held,
                            _tokens_of(token_blob), blocks, ring_bytes, float(saved_at),
                            disk_bytes, images)

    def _block_sizes(self, name: str) -> int:
        if _name_is(name)[0] != "name = ?":
            return 0  # a damaged name: no index row is under it
        return self._db.execute(
            "SELECT COALESCE(SUM(b.nbytes), 0) FROM session_blocks s JOIN blocks b "
            "ON s.block = b.hash WHERE s.session = ?", (name,)).fetchone()[0]

    def has(self, name: str) -> bool:
        where, param = _name_is(name)
        return self._db.execute(f"SELECT 1 FROM sessions WHERE {where}", param
                                ).fetchone() is not None

    def names(self) -> list[str]:
        return [row[0] for row in self._db.execute("SELECT name FROM sessions ORDER BY name")]

    def remove(self, name: str) -> None:
        """Remove a session, a damaged one too (its name as `names` gives it)."""
        where, param = _name_is(name)
        with self._transaction():
            gone = self._db.execute(f"DELETE FROM sessions WHERE {where}", param).rowcount
            # The index rows of a name that was damaged on disk are matched by no name.
            self._db.execute("DELETE FROM session_blocks WHERE session NOT IN "
                             "(SELECT name FROM sessions)")
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
            # Orphaned, the rows go (the budget counts what the manifest names) but the
            # files stay for whoever restores the manifest that names them.
            if self.orphaned is None:
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


def check_session_name(name: str) -> None:
    """Refuse a name no session may have, before any work is done under it."""
    if (not isinstance(name, str) or not name or len(name) > 256 or "/" in name
            or name.startswith(".") or "\0" in name):
        raise ValueError(f"session name {str(name)[:80]!r}: use 1 to 256 characters, without "
                         "'/' or NUL, not starting with '.'")


def _name_is(name: str) -> tuple[str, tuple[str | bytes]]:
    """A WHERE clause for session `name`. A name read from a damaged row may hold bytes
    that are not UTF-8 (surrogate escapes): it is matched by its bytes, every other name
    through the primary key."""
    try:
        name.encode()
        return "name = ?", (name,)
    except UnicodeEncodeError:
        return "CAST(name AS BLOB) = ?", (name.encode("utf-8", "surrogateescape"),)


def _stamp_signature(directory: str, key: bytes) -> str:
    """What makes a manifest this directory's: its id signed with the directory's key."""
    return hmac.new(key, b"kvstack manifest\0" + directory.encode(), hashlib.sha256).hexdigest()


def _prefix_checksum(chain_hash: str, block: str, key: bytes) -> str:
    return hmac.new(key, f"prefix\0{chain_hash}\0{block}".encode(), hashlib.sha256).hexdigest()


def _owner_only(path: Path, mode: int) -> None:
    """Close a file or directory this user owns to others (an older kvstack's were
    readable); another owner's is left as it is."""
    st = path.stat()
    if st.st_uid == os.getuid() and st.st_mode & 0o077:
        os.chmod(path, mode)


@contextmanager
def _open_lock(root: Path) -> Iterator[None]:
    """The directory's open lock (an advisory lock on `root/lock`, released when the
    process dies): first opens make one manifest, one key and one schema."""
    fd = os.open(root / OPEN_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


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
