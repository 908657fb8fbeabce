"""The disk tier when its manifest is lost, emptied, damaged or another's: no block file is
deleted, a restored manifest brings every session back, `recover` lifts the mark; rows
are decoded one at a time, so damage stays with its session."""

import json
import multiprocessing
import os
import shutil
import sqlite3
import stat

import pytest
from test_disk_sharing import blocks_of, save

from kvstack.cache.disk import DamagedSession, DiskTier, SavedSession
from kvstack.cli import main

SESSIONS = ("a", "b", "c")


def saved_directory(root):
    disk = DiskTier(root, 1 << 30)
    for name in SESSIONS:
        save(disk, name)
    disk.close()
    return sorted(p.name for p in (root / "blocks").rglob("*.blk"))


def empty_database(path):
    path.unlink()
    sqlite3.connect(path).close()


def another_directorys(path):
    other = path.parent.parent / "other"
    save(DiskTier(other, 1 << 30), "theirs")
    shutil.copy(other / "manifest.sqlite", path)


DAMAGE = {
    "deleted": lambda path: path.unlink(),
    "emptied": lambda path: path.write_bytes(b""),
    "truncated": lambda path: path.write_bytes(path.read_bytes()[:6000]),
    "garbage": lambda path: path.write_bytes(b"not a database " * 400),
    "an empty database": empty_database,
    "another directory's": another_directorys,
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_lost_or_replaced_manifest_deletes_no_block_file(tmp_path, damage, capsys):
    root = tmp_path / "cache"
    files = saved_directory(root)
    backup = (root / "manifest.sqlite").read_bytes()
    DAMAGE[damage](root / "manifest.sqlite")
    saved_meanwhile = False
    for _ in range(3):
        try:
            disk = DiskTier(root, 1 << 30)
        except ValueError as e:  # an unreadable manifest is said, not swept
            assert "cannot be read" in str(e)
        else:
            assert disk.orphaned
            save(disk, "new")  # the directory stays usable meanwhile
            disk.remove("new")
            saved_meanwhile = True
        main(["session", "list", "--cache-dir", str(root)])
        assert set(files) <= {p.name for p in (root / "blocks").rglob("*.blk")}
    capsys.readouterr()
    (root / "manifest.sqlite").write_bytes(backup)  # restored from the backup
    disk = DiskTier(root, 1 << 30)
    for name in SESSIONS:
        assert disk.load(name, "model")[1] == blocks_of(name, 0)
    # The blocks of "new", saved and removed while orphaned, are named by no manifest now.
    assert main(["session", "recover", "--cache-dir", str(root)]) == (
        2 if saved_meanwhile else 0)
    assert main(["session", "recover", "--discard", "--cache-dir", str(root)]) == 0
    assert disk.orphaned is None
    assert sorted(p.name for p in (root / "blocks").rglob("*.blk")) == files


def test_recover_keeps_what_no_manifest_names_until_told_to_discard_it(tmp_path, capsys):
    files = saved_directory(tmp_path)
    (tmp_path / "manifest.sqlite").unlink()  # lost, and no backup
    disk = DiskTier(tmp_path, 1 << 30)
    save(disk, "after")
    assert main(["session", "recover", "--cache-dir", str(tmp_path)]) == 2
    assert "named by no session" in capsys.readouterr().err
    assert set(files) <= {p.name for p in (tmp_path / "blocks").rglob("*.blk")}
    assert main(["session", "recover", "--discard", "--cache-dir", str(tmp_path),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["sessions"] == 1 and report["files_discarded"] == 3 * 3
    assert {p.stem for p in (tmp_path / "blocks").rglob("*.blk")} == set(
        DiskTier(tmp_path, 1 << 30).show("after").blocks)
    assert disk.orphaned is None


def test_recover_resign_trusts_a_manifest_whose_key_was_lost(tmp_path, capsys):
    saved_directory(tmp_path)
    (tmp_path / "manifest.key").unlink()
    disk = DiskTier(tmp_path, 1 << 30)
    assert all(isinstance(s, DamagedSession) for s in disk.sessions())
    assert main(["session", "recover", "--cache-dir", str(tmp_path)]) == 2
    assert "--resign" in capsys.readouterr().err
    assert main(["session", "recover", "--resign", "--cache-dir", str(tmp_path)]) == 0
    fresh = DiskTier(tmp_path, 1 << 30)
    assert fresh.orphaned is None
    assert [fresh.load(n, "model")[1] for n in SESSIONS] == [blocks_of(n, 0) for n in SESSIONS]


def _open_all(roots):
    keys = []
    for root in roots:
        DiskTier(root, 1 << 30).close()
        keys.append((root / "manifest.key").read_bytes().hex())
    return keys


def test_concurrent_first_opens_of_new_directories_make_one_manifest(tmp_path):
    roots = [tmp_path / f"d{i}" for i in range(12)]
    with multiprocessing.get_context("fork").Pool(6) as pool:
        results = pool.map(_open_all, [roots] * 6)  # an error in any open is raised here
    assert all(keys == results[0] for keys in results)  # one key per directory
    for root in roots:
        disk = DiskTier(root, 1 << 30)
        assert disk.orphaned is None and disk.sessions() == []


def test_a_row_that_is_not_utf8_or_wrongly_typed_is_that_session_damaged_alone(tmp_path,
                                                                               capsys):
    disk = DiskTier(tmp_path, 1 << 30)
    for name in ("good", "bad-bytes", "bad-type"):
        save(disk, name)
    disk._db.execute("UPDATE sessions SET name = CAST(X'6261642dff' AS TEXT) "
                     "WHERE name = 'bad-bytes'")
    disk._db.execute("UPDATE sessions SET saved_at = 'yesterday' WHERE name = 'bad-type'")
    disk.close()
    reopened = DiskTier(tmp_path, 1 << 30)
    listing = reopened.sessions()
    assert [type(s) for s in listing] == [DamagedSession, DamagedSession, SavedSession]
    assert listing[2].name == "good"
    assert main(["session", "list", "--cache-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "good" in out and out.count("damaged") == 2 and "wrong type" in err
    assert main(["session", "list", "--cache-dir", str(tmp_path), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 3
    for damaged in listing[:2]:
        reopened.remove(damaged.name)
    assert reopened.names() == ["good"]
    assert reopened.load("good", "model")[1] == blocks_of("good", 0)


def test_a_damaged_prefix_row_is_dropped_not_raised(tmp_path, caplog):
    disk = DiskTier(tmp_path, 1 << 30)
    payload = b"p" * 256
    assert disk.put_prefix("aa" * 32, payload)
    assert disk.take_prefix("aa" * 32) == payload
    block = disk._db.execute("SELECT block FROM prefix_blocks").fetchone()[0]
    for forged in ("../../x", "zz" * 32):  # not a block name; a name signed by nobody
        disk._db.execute("INSERT OR REPLACE INTO prefix_blocks VALUES (?, ?, 0, NULL)",
                         ("bb" * 32, forged))
        assert disk.take_prefix("bb" * 32) is None
        assert not disk.has_prefix("bb" * 32)
    # a signed-looking row that points at another block: signed over the chain hash
    disk._db.execute("INSERT INTO prefix_blocks SELECT ?, block, used_at, checksum FROM "
                     "prefix_blocks WHERE chain_hash = ?", ("cc" * 32, "aa" * 32))
    assert disk.take_prefix("cc" * 32) is None
    assert disk.take_prefix("aa" * 32) == payload and block
    assert "prefix-cache entry" in caplog.text


def test_directories_an_older_version_left_readable_are_closed(tmp_path):
    save(DiskTier(tmp_path, 1 << 30), "a")
    for path in (tmp_path, tmp_path / "blocks"):
        os.chmod(path, 0o755)
    os.chmod(tmp_path / "manifest.sqlite", 0o644)
    DiskTier(tmp_path, 1 << 30)
    for path in (tmp_path, tmp_path / "blocks", tmp_path / "manifest.sqlite"):
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0


def test_a_manifest_that_cannot_be_read_is_an_error_not_a_traceback(tmp_path, capsys):
    saved_directory(tmp_path)
    (tmp_path / "manifest.sqlite").write_bytes(b"garbage" * 1000)
    assert main(["session", "list", "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "cannot be read" in err and "Traceback" not in err and "recover" in err
