"""The disk tier shared by threads and processes: nothing committed is lost, damage is
confined and repaired, transactions end, manifest names never leave the directory."""

import errno
import hashlib
import json
import os
import random
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time

import pytest

from kvstack.cache.disk import DiskTier, _row_checksum, _token_blob

SYSTEM = [bytes([7]) * 512, bytes([8]) * 512]  # blocks every session shares


def blocks_of(name: str, version: int, n: int = 3) -> list[bytes]:
    own = [hashlib.sha256(f"{name}/{version}/{i}".encode()).digest() * 16 for i in range(n)]
    return SYSTEM + own


def save(disk: DiskTier, name: str, version: int = 0) -> list[bytes]:
    payloads = blocks_of(name, version)
    disk.save(name, "model", 16, 16 * len(payloads), list(range(16 * len(payloads))),
              payloads, 100)
    return payloads


def paused_in(monkeypatch, method: str) -> tuple[threading.Event, threading.Event]:
    """Make DiskTier.<method> stop (once, on the worker thread) until released."""
    reached, release = threading.Event(), threading.Event()
    original = getattr(DiskTier, method)
    main = threading.get_ident()

    def paused(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if threading.get_ident() != main and not reached.is_set():
            reached.set()
            assert release.wait(30)
        return out

    monkeypatch.setattr(DiskTier, method, paused)
    return reached, release


def in_thread(fn) -> threading.Thread:
    errors = []

    def run():
        try:
            fn()
        except BaseException as e:  # handed to the test below
            errors.append(e)

    t = threading.Thread(target=run)
    t.errors = errors
    t.start()
    return t


def test_opening_the_directory_during_a_save_takes_none_of_its_files(tmp_path, monkeypatch):
    reached, release = paused_in(monkeypatch, "_write_block")
    writer = in_thread(lambda: save(DiskTier(tmp_path, 1 << 30), "work"))
    assert reached.wait(30)
    other = DiskTier(tmp_path, 1 << 30)  # sweeps what a killed writer would have left
    assert other.names() == []
    release.set()
    writer.join()
    assert not writer.errors
    _, payloads = other.load("work", "model")
    assert payloads == blocks_of("work", 0)


def test_removing_a_session_during_a_save_keeps_the_blocks_it_reuses(tmp_path, monkeypatch):
    disk = DiskTier(tmp_path, 1 << 30)
    save(disk, "old")
    reached, release = paused_in(monkeypatch, "_intact")  # the shared blocks, found stored
    writer = in_thread(lambda: save(DiskTier(tmp_path, 1 << 30), "new"))
    assert reached.wait(30)
    disk.remove("old")  # the shared system blocks lose their last committed owner
    release.set()
    writer.join()
    assert not writer.errors
    assert disk.load("new", "model")[1] == blocks_of("new", 0)


def test_a_damaged_block_is_rewritten_by_the_next_save_of_its_bytes(tmp_path):
    disk = DiskTier(tmp_path, 1 << 30)
    save(disk, "a")
    shared = disk.block_path(hashlib.sha256(SYSTEM[0]).hexdigest())
    shared.write_bytes(b"\0" * 512)  # one block, shared by every session
    with pytest.raises(ValueError, match="corrupt"):
        disk.load("a", "model")
    save(disk, "b")  # holds the good bytes in memory: the file is repaired
    assert disk.load("a", "model")[1] == blocks_of("a", 0)


def test_a_failed_commit_is_rolled_back_and_the_lock_released(tmp_path, monkeypatch):
    disk = DiskTier(tmp_path, 1 << 30)
    save(disk, "a")
    real = DiskTier._db.fget

    class FailingCommit:
        def __init__(self, db):
            self.db = db

        def execute(self, sql, *args):
            if sql == "COMMIT" and not failed:
                failed.append(True)
                raise sqlite3.OperationalError("database or disk is full")
            return self.db.execute(sql, *args)

        def __getattr__(self, name):
            return getattr(self.db, name)

    failed = []
    monkeypatch.setattr(DiskTier, "_db", property(lambda self: FailingCommit(real(self))))
    with pytest.raises(sqlite3.OperationalError, match="disk is full"):
        save(disk, "b")
    monkeypatch.setattr(DiskTier, "_db", property(real))
    assert not disk._db.in_transaction
    other = DiskTier(tmp_path, 1 << 30)  # another process can write: no lock is held
    save(other, "c")
    assert sorted(disk.names()) == ["a", "c"]
    assert other._db.execute("SELECT COUNT(*) FROM pins").fetchone()[0] == 0


def test_a_full_disk_names_the_session_and_loses_nothing(tmp_path, monkeypatch):
    disk = DiskTier(tmp_path, 1 << 30)
    save(disk, "a")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=r"while saving session .a. in .*: No space left"):
        save(disk, "a", version=1)
    monkeypatch.undo()
    assert disk.load("a", "model")[1] == blocks_of("a", 0)  # the old state
    save(disk, "a", version=1)
    assert disk.load("a", "model")[1] == blocks_of("a", 1)


def test_manifest_names_never_become_paths_outside_the_directory(tmp_path):
    outside = tmp_path / "victim.blk"
    outside.write_bytes(b"keep me")
    disk = DiskTier(tmp_path / "cache", 1 << 30)
    save(disk, "a")
    forged = "../../victim"
    disk._db.execute("INSERT INTO blocks VALUES (?, 7)", (forged,))
    blocks = json.dumps([forged])
    fields = ("model", 1, 16, 16, _token_blob([1]), blocks, 0)

    def row(name: str, key: bytes | None) -> None:
        checksum = _row_checksum(name, *fields, key=key)
        disk._db.execute("INSERT INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, '')",
                         (name, *fields, 0.0, checksum))

    row("forged", None)  # a bare SHA-256, as anyone who can write the manifest computes it
    row("signed", disk._key)  # signed with the directory's key, naming a path outside
    DiskTier(tmp_path / "cache", 1 << 30)  # open: sweep and collect
    disk.remove("a")
    assert outside.read_bytes() == b"keep me"
    with pytest.raises(ValueError, match="corrupt"):
        disk.load("forged", "model")
    with pytest.raises(ValueError, match="not a block name"):
        disk.load("signed", "model")


def test_files_are_the_users_alone(tmp_path):
    disk = DiskTier(tmp_path / "cache", 1 << 30)
    save(disk, "a")
    block = disk.block_path(hashlib.sha256(SYSTEM[0]).hexdigest())
    for path, mode in ((disk.root, 0o700), (disk.blocks_dir, 0o700), (block.parent, 0o700),
                       (block, 0o600), (disk.manifest, 0o600),
                       (disk.root / "manifest.key", 0o600)):
        assert stat.S_IMODE(path.stat().st_mode) == mode, path


def test_threads_saving_overlapping_sessions_lose_nothing(tmp_path):
    disk = DiskTier(tmp_path, 1 << 30)

    def work(k: int) -> None:
        for v in range(14):
            save(disk, f"s{k}", v)
            if v % 5 == 4:
                disk.remove(f"s{k}")

    threads = [in_thread(lambda k=k: work(k)) for k in range(3)]
    for t in threads:
        t.join()
        assert not t.errors
    for k in range(3):
        assert disk.load(f"s{k}", "model")[1] == blocks_of(f"s{k}", 13)


STRESS = """
import random, sys, time
sys.path.insert(0, {tests!r})
from test_disk_sharing import save
from kvstack.cache.disk import DiskTier
root, seed, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
rng = random.Random(seed)
disk = DiskTier(root, 1 << 30)
end = time.time() + seconds
while time.time() < end:
    name = f"s{{rng.randrange(4)}}"
    op = rng.random()
    if op < 0.6:
        version = rng.randrange(1000)
        save(disk, name, version)
        print("saved", name, version, flush=True)
    elif op < 0.8:
        try:
            disk.remove(name)
            print("removed", name, flush=True)
        except ValueError:
            pass
    else:
        DiskTier(root, 1 << 30).names()
"""


def test_processes_saving_removing_and_opening_one_directory_with_kills(tmp_path):
    """Four processes on one directory for a few seconds, two of them killed and
    restarted: every session the manifest holds at the end loads, as some process saved
    it; no block file is left that nothing names."""
    script = tmp_path / "stress.py"
    script.write_text(STRESS.format(tests=os.path.dirname(__file__)))
    root = tmp_path / "cache"
    DiskTier(root, 1 << 30)
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}

    def start(seed: int, seconds: float) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), str(root), str(seed),
                                 str(seconds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env)

    procs = [start(seed, 6.0) for seed in range(4)]
    rng = random.Random(1)
    for victim in (0, 1):
        time.sleep(rng.uniform(1.0, 2.5))
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait()
        procs.append(start(10 + victim, 2.0))
    saved: dict[str, set[int]] = {}
    for p in procs:
        out, err = p.communicate(timeout=120)
        if p.returncode not in (0, -signal.SIGKILL):
            raise AssertionError(err)
        if p.returncode == 0:
            assert not err, err
        for line in out.splitlines():
            if line.startswith("saved"):
                _, name, version = line.split()
                saved.setdefault(name, set()).add(int(version))
    disk = DiskTier(root, 1 << 30)
    assert sum(len(v) for v in saved.values()) > 20 and disk.names()
    for name in disk.names():
        _, payloads = disk.load(name, "model")
        # One whole version of this session (a killed save may have committed without
        # printing, so which one is not checked against the log).
        assert any(blocks_of(name, v) == payloads for v in range(1000)), name
    named = {b for name in disk.names() for b in disk.show(name).blocks}
    files = {p.stem for p in disk.blocks_dir.rglob("*.blk")}
    assert files == named


def test_session_list_shows_intact_sessions_beside_a_damaged_one(tmp_path, capsys):
    from kvstack.cli import main

    disk = DiskTier(tmp_path, 1 << 30)
    save(disk, "good")
    save(disk, "[bold]\x1b[31mred")  # markup and an ANSI escape in a name
    save(disk, "bad")
    disk._db.execute("UPDATE sessions SET held_tokens = held_tokens + 1 WHERE name = 'bad'")
    assert main(["session", "list", "--cache-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "good" in out and "damaged" in out and "\x1b" not in out
    assert "[bold]\\x1b[31mred" in out  # shown, not acted on
    assert "session bad: " in err and "corrupt" in err
    assert main(["session", "list", "--cache-dir", str(tmp_path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {r["name"] for r in listed} == {"good", "[bold]\x1b[31mred", "bad"}
    assert next(r for r in listed if r["name"] == "bad")["damaged"]


def test_request_settings_are_typed_strictly():
    from kvstack import SamplingParams
    from kvstack.units import parse_bytes

    for bad, field in ((dict(max_tokens=True), "max_tokens"), (dict(ignore_eos="no"),
                       "ignore_eos"), (dict(seed=1 << 64), "seed"), (dict(seed=-1), "seed"),
                       (dict(temperature=True), "temperature"), (dict(top_k=False), "top_k")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)
    for text in ("inf", "nan", "-inf GiB"):
        with pytest.raises(ValueError, match="not a size"):
            parse_bytes(text)


def test_another_tokenizer_is_another_fingerprint(tmp_path):
    import shutil

    from kvstack import LLM
    from kvstack.engine.loading import bundled_model

    shutil.copytree(bundled_model(), tmp_path / "m")
    same = LLM(tmp_path / "m", kv_budget="16MiB", threads=1, cache_dir=tmp_path / "c")
    tokenizer = tmp_path / "m" / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text() + "\n")  # same ids, other bytes: not trusted
    other = LLM(tmp_path / "m", kv_budget="16MiB", threads=1, cache_dir=tmp_path / "c")
    assert same.model.fingerprint() == other.model.fingerprint()
    assert same.fingerprint != other.fingerprint


def test_a_damaged_or_lost_index_deletes_no_session_block(tmp_path):
    disk = DiskTier(tmp_path, 1 << 30)
    save(disk, "a")
    disk._db.execute("DELETE FROM session_blocks")  # the index of the records, damaged
    save(disk, "b")  # collects garbage
    disk._db.execute("DROP TABLE blocks")  # a table gone
    DiskTier(tmp_path, 1 << 30)  # opening sweeps
    assert disk.load("a", "model")[1] == blocks_of("a", 0)
    (tmp_path / "manifest.sqlite").unlink()  # the manifest lost
    DiskTier(tmp_path, 1 << 30)
    assert len(list((tmp_path / "blocks").rglob("*.blk"))) == len(
        set(blocks_of("a", 0)) | set(blocks_of("b", 0)))


def test_a_full_disk_under_the_prefix_cache_costs_no_request(tmp_path, monkeypatch):
    from kvstack import LLM, SamplingParams

    llm = LLM("tiny", random_init=True, kv_budget="2MiB", block_tokens=16,
              cache_dir=tmp_path, disk_prefix_cache=True)
    free = llm.cache.free_blocks

    def full(self, chain_hash, payload):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskTier, "put_prefix", full)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outs = llm.generate([list(range(1, 60)), list(range(2, 50))], params)
    assert [len(o.token_ids) for o in outs] == [40, 40]
    assert all(o.finish_reason == "length" for o in outs)
    assert llm.cache.free_blocks == free


def test_rows_of_a_manifest_from_before_the_key_are_signed_once(tmp_path):
    disk = DiskTier(tmp_path, 1 << 30)
    save(disk, "old")
    fields = disk._db.execute("SELECT * FROM sessions WHERE name = 'old'").fetchone()[:8]
    disk._db.execute("UPDATE sessions SET checksum = ?", (_row_checksum(*fields),))
    disk._db.execute("DROP TABLE directory")  # as a manifest written before keys were
    (tmp_path / "manifest.key").unlink()
    reopened = DiskTier(tmp_path, 1 << 30)
    assert reopened.load("old", "model")[1] == blocks_of("old", 0)
    assert reopened._key != disk._key
    assert reopened.orphaned is None


def test_a_deleted_key_refuses_signed_rows_rather_than_accepting_unsigned_ones(tmp_path):
    disk = DiskTier(tmp_path, 1 << 30)
    save(disk, "real")
    fields = disk._db.execute("SELECT * FROM sessions WHERE name = 'real'").fetchone()[:8]
    forged = ("forged", *fields[1:])
    disk._db.execute("INSERT INTO sessions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, '')",
                     (*forged, 0.0, _row_checksum(*forged)))  # a bare SHA-256
    key = (tmp_path / "manifest.key").read_bytes()
    (tmp_path / "manifest.key").unlink()
    files = sorted(p.name for p in (tmp_path / "blocks").rglob("*.blk"))
    for _ in range(3):
        reopened = DiskTier(tmp_path, 1 << 30)
        assert "manifest.key was lost" in reopened.orphaned
        for name in ("real", "forged"):
            with pytest.raises(ValueError, match="corrupt"):
                reopened.load(name, "model")
    assert sorted(p.name for p in (tmp_path / "blocks").rglob("*.blk")) == files
    (tmp_path / "manifest.key").write_bytes(key)  # restored from a backup
    restored = DiskTier(tmp_path, 1 << 30)
    assert restored.load("real", "model")[1] == blocks_of("real", 0)
    assert restored.orphaned is None  # the manifest is whole again: the mark lifts
    with pytest.raises(ValueError, match="corrupt"):
        restored.load("forged", "model")


def test_a_malformed_prefix_row_costs_no_request_nor_its_neighbours(tmp_path):
    from kvstack import LLM, SamplingParams

    def engine():
        return LLM("tiny", random_init=True, kv_budget="2MiB", block_tokens=16,
                   cache_dir=tmp_path, disk_prefix_cache=True)

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    shared = list(range(1, 70))
    first = engine().generate([shared], params)[0].token_ids
    disk = DiskTier(tmp_path, 1 << 30)
    assert disk._db.execute("SELECT COUNT(*) FROM prefix_blocks").fetchone()[0] >= 4
    disk._db.execute("UPDATE prefix_blocks SET block = '../../not-a-block' WHERE rowid = "
                     "(SELECT MIN(rowid) FROM prefix_blocks)")
    disk._db.execute("UPDATE prefix_blocks SET checksum = NULL WHERE rowid = "
                     "(SELECT MAX(rowid) FROM prefix_blocks)")
    outs = engine().generate([shared] + [list(range(2 + i, 40 + i)) for i in range(4)], params)
    assert [o.finish_reason for o in outs] == ["length"] * 5
    assert outs[0].token_ids == first  # recomputed where the cache had no usable block
