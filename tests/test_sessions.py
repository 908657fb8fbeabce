"""Persistent sessions on the disk tier: resume in another process, corruption, foreign
sessions, kills during a save, the disk budget, the CLI."""

import importlib.util
import json
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import kvstack.cache.disk as disk_module
from kvstack import LLM, SamplingParams
from kvstack.cache.disk import DiskTier
from kvstack.cache.paged import block_bytes
from kvstack.cli import main
from kvstack.config import preset

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[1]


def tiny_llm(cache_dir: Path, seed: int = 0, **kwargs) -> LLM:
    kwargs = {"kv_budget": "2MiB", "replay": "exact", "block_tokens": 8} | kwargs
    return LLM("tiny", random_init=True, seed=seed, cache_dir=cache_dir, **kwargs)


def test_exact_resume_in_another_process_continues_token_for_token(tmp_path):
    llm = tiny_llm(tmp_path)
    session = llm.session("work")
    session.append(list(range(3, 70)))
    session.generate(GREEDY)
    session.append([7, 8, 9])
    session.save()
    uninterrupted = session.generate(GREEDY).token_ids

    script = textwrap.dedent(f"""
        import json
        from kvstack import LLM, SamplingParams
        llm = LLM("tiny", random_init=True, seed=0, kv_budget="2MiB", replay="exact",
                  block_tokens=8, cache_dir={str(tmp_path)!r})
        out = llm.resume("work").generate(SamplingParams(max_tokens=12, temperature=0,
                                                         ignore_eos=True))
        print(json.dumps(out.token_ids))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True, cwd=ROOT)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == uninterrupted


def test_a_turn_stopped_early_keeps_what_was_shown_and_saves_with_it(tmp_path):
    llm = tiny_llm(tmp_path)
    session = llm.session("s")
    session.append(list(range(3, 40)))
    turn = session.stream(GREEDY)
    shown = [next(turn), next(turn), next(turn)][-1]
    turn.close()  # Ctrl-C in `kvstack chat`
    assert shown.token_ids and not shown.finished
    assert session.token_ids == list(range(3, 40)) + shown.token_ids
    assert llm.memory_report()["blocks_in_use"] == 0  # the stopped request is freed
    session.append([5, 6])
    session.save()
    stopped_then_on = session.generate(GREEDY).token_ids
    fresh = llm.session("fresh")
    fresh.append(list(range(3, 40)) + shown.token_ids + [5, 6])
    assert stopped_then_on == fresh.generate(GREEDY).token_ids
    llm.close()
    resumed = tiny_llm(tmp_path).resume("s")
    assert resumed.token_ids == list(range(3, 40)) + shown.token_ids + [5, 6]


def test_a_saved_session_holds_blocks_and_token_ids_not_window_rings(tmp_path):
    llm = tiny_llm(tmp_path)
    session = llm.session("s")
    session.append(list(range(1, 41)))
    session.generate(GREEDY)
    session.save()
    saved = llm.disk.show("s")
    assert saved.token_ids == session.token_ids  # 40 prompt + 12 generated
    assert saved.held_tokens == 51  # the last sampled token is not fed yet
    per_block = sum(len(p) for p in llm.disk.load("s", llm.fingerprint)[1]) // len(saved.blocks)
    assert len(saved.blocks) == 7 and saved.disk_bytes == 7 * per_block
    report = session.report()
    assert report["disk_bytes"] == saved.disk_bytes
    assert report["window_ring_bytes"] == llm.cache.layout.window_bytes_per_sequence > 0
    assert report["disk_bytes_with_window_rings"] == saved.disk_bytes + report[
        "window_ring_bytes"]


def test_a_saved_block_holds_only_the_sessions_own_rows(tmp_path):
    layout = tiny_llm(tmp_path).cache.layout
    budget = layout.window_bytes_per_sequence * 8 + 16 * block_bytes(layout, 8)

    def save_after(churn: bool) -> list[bytes]:
        llm = tiny_llm(tmp_path / str(churn), kv_budget=budget, enable_prefix_caching=False)
        if churn:  # another request uses, then frees, blocks the session will get
            llm.generate(list(range(200, 300)), GREEDY)
        session = llm.session("s")
        session.append(list(range(1, 31)))  # 41 tokens held: the last block has one
        session.generate(GREEDY)
        session.save()
        return llm.disk.load("s", llm.fingerprint)[1]

    assert save_after(churn=False) == save_after(churn=True)


def two_sessions(tmp_path) -> LLM:
    llm = tiny_llm(tmp_path)
    for name, start in (("a", 1), ("b", 100)):
        session = llm.session(name)
        session.append(list(range(start, start + 30)))
        session.generate(GREEDY)
        session.save()
    return llm


def test_a_corrupt_block_file_fails_that_session_alone(tmp_path):
    llm = two_sessions(tmp_path)
    block = llm.disk.block_path(llm.disk.show("a").blocks[1])
    data = bytearray(block.read_bytes())
    data[5] ^= 0x10
    block.write_bytes(bytes(data))
    fresh = tiny_llm(tmp_path)
    with pytest.raises(ValueError, match=rf"session 'a'.*{block.name}.*corrupt"):
        fresh.resume("a")
    assert fresh.resume("b").generate(GREEDY).token_ids


def test_a_damaged_shared_block_heals_from_the_copy_the_prefix_cache_holds(tmp_path):
    """Two sessions on one system prompt name the same first block file. Damaged, it fails
    only the sessions that hold it while no tier has its bytes; an engine whose prefix
    cache still holds them rewrites the file on resume, and then every session loads."""
    system = list(range(1, 17))  # two full blocks of 8, shared
    llm = tiny_llm(tmp_path)
    for name, turn in (("a", [40, 41, 42]), ("b", [50, 51]), ("c", None)):
        session = llm.session(name)
        session.append(system + turn if turn else list(range(200, 230)))
        session.generate(GREEDY)
        session.save()
        session.close()
    shared = llm.disk.show("a").blocks[0]
    assert shared == llm.disk.show("b").blocks[0] and shared not in llm.disk.show("c").blocks
    path = llm.disk.block_path(shared)
    path.write_bytes(b"\0" + path.read_bytes()[1:])

    fresh = tiny_llm(tmp_path, enable_prefix_caching=False)  # no tier holds the bytes
    for name in ("a", "b"):
        with pytest.raises(ValueError, match=rf"session {name!r}.*{path.name}.*corrupt"):
            fresh.resume(name)
    assert fresh.resume("c").generate(GREEDY).token_ids

    expected = tiny_llm(tmp_path / "reference").session("a")
    expected.append(llm.disk.show("a").token_ids)
    assert llm.resume("a").generate(GREEDY).token_ids == expected.generate(GREEDY).token_ids
    assert llm.disk._intact(shared)
    assert tiny_llm(tmp_path).resume("b").generate(GREEDY).token_ids


def test_a_corrupt_manifest_record_fails_that_session_alone(tmp_path):
    llm = two_sessions(tmp_path)
    tokens_of_a = b"".join(t.to_bytes(4, "little") for t in llm.disk.show("a").token_ids)
    llm.disk.close()
    manifest = tmp_path / "manifest.sqlite"
    data = bytearray(manifest.read_bytes())
    at = data.find(tokens_of_a)
    assert at >= 0
    data[at + 9] ^= 0x01
    manifest.write_bytes(bytes(data))
    fresh = tiny_llm(tmp_path)
    with pytest.raises(ValueError, match=r"session 'a'.*manifest.sqlite.*corrupt"):
        fresh.resume("a")
    assert fresh.resume("b").generate(GREEDY).token_ids


def test_sessions_of_another_model_or_format_version_are_refused(tmp_path, monkeypatch):
    two_sessions(tmp_path)
    with pytest.raises(ValueError, match="session 'a' was saved by another model"):
        tiny_llm(tmp_path, seed=1).resume("a")
    bf16_cache = preset("tiny").replace(kv_format="bf16")
    with pytest.raises(ValueError, match="session 'a' was saved by another model"):
        LLM(bf16_cache, random_init=True, kv_budget="2MiB", block_tokens=8,
            cache_dir=tmp_path).resume("a")
    monkeypatch.setattr(disk_module, "FORMAT_VERSION", 0)
    old = tiny_llm(tmp_path)
    session = old.session("old")
    session.append([1, 2, 3])
    session.save()
    monkeypatch.setattr(disk_module, "FORMAT_VERSION", 1)
    with pytest.raises(ValueError, match="session 'old' was saved in format version 0"):
        tiny_llm(tmp_path).resume("old")


def test_the_disk_budget_refuses_a_save_and_loses_nothing(tmp_path):
    llm = tiny_llm(tmp_path, disk_budget=20_000)
    first = llm.session("first")
    first.append(list(range(1, 60)))
    first.generate(GREEDY)
    first.save()
    before = llm.disk.show("first")
    big = llm.session("big")
    big.append(list(range(100, 400)))
    big.generate(GREEDY)
    with pytest.raises(ValueError, match="disk budget full: session 'big' needs"):
        big.save()
    assert llm.disk.names() == ["first"]
    assert llm.disk.show("first") == before
    assert tiny_llm(tmp_path).resume("first").generate(GREEDY).token_ids


KILL_LOOP = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("disk", sys.argv[1])
disk = importlib.util.module_from_spec(spec)
spec.loader.exec_module(disk)  # the standard library only: starts in milliseconds
tier = disk.DiskTier(sys.argv[2], 1 << 30)
states = [([i % 256 for i in range(n)], [bytes([(n + j) % 251]) * 4096 for j in range(n // 8)])
          for n in (64, 160)]
print("ready", flush=True)
i = 1
while True:
    tokens, payloads = states[i % 2]
    tier.save("s", "fp", 8, len(tokens), tokens, payloads, 100)
    i += 1
"""


def test_a_kill_at_any_moment_of_a_save_leaves_the_old_or_the_new_session(tmp_path):
    disk_file = importlib.util.find_spec("kvstack.cache.disk").origin
    states = {n: ([i % 256 for i in range(n)],
                  [bytes([(n + j) % 251]) * 4096 for j in range(n // 8)]) for n in (64, 160)}
    DiskTier(tmp_path, 1 << 30).save("s", "fp", 8, 64, *states[64], 100)
    rng = random.Random(0)
    seen = set()
    kills = 0
    # At least 24 kills, and on until both states have been seen: on a loaded machine a
    # save can take longer than the first delays, so they grow by 50 ms every 24 kills.
    while kills < 24 or (seen != {64, 160} and kills < 240):
        child = subprocess.Popen([sys.executable, "-c", KILL_LOOP, disk_file, str(tmp_path)],
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.05 * (1 + kills // 24)))
        kills += 1
        child.send_signal(signal.SIGKILL)
        child.wait()
        tier = DiskTier(tmp_path, 1 << 30)
        saved, payloads = tier.load("s", "fp")
        assert (saved.token_ids, payloads) in (states[64], states[160])
        seen.add(len(saved.token_ids))
        tier.close()
    assert seen == {64, 160}  # the kills landed while saves were running
    tier = DiskTier(tmp_path, 1 << 30)
    tier.save("s", "fp", 8, 64, *states[64], 100)
    files = {p.stem for p in (tmp_path / "blocks").rglob("*") if p.is_file()}
    assert files == set(tier.show("s").blocks)  # what kills left behind is gone


def test_session_commands_list_show_and_remove(tmp_path, capsys):
    two_sessions(tmp_path)
    assert main(["session", "list", "--cache-dir", str(tmp_path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in listed] == ["a", "b"]
    assert listed[0]["disk_bytes_with_window_rings"] > listed[0]["disk_bytes"] > 0
    assert main(["session", "show", "a", "--cache-dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 42
    assert main(["session", "rm", "a", "--cache-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["session", "rm", "a", "--cache-dir", str(tmp_path)]) != 0
    assert "no saved session 'a'" in capsys.readouterr().err
    tier = DiskTier(tmp_path, 1 << 30)
    assert tier.names() == ["b"]
    assert {p.stem for p in tmp_path.rglob("*.blk")} == set(tier.show("b").blocks)


def test_chat_with_a_session_saves_each_turn_and_resumes(tmp_path, monkeypatch, capsys):
    args = ["chat", "--model", "tiny", "--random-init", "--kv-budget", "2MiB",
            "--max-tokens", "5", "--temperature", "0", "--ignore-eos", "--session", "talk",
            "--cache-dir", str(tmp_path)]
    lines = iter(["hello", "/exit"])
    monkeypatch.setattr("builtins.input", lambda _: next(lines))
    assert main(args) == 0
    saved = DiskTier(tmp_path, 1 << 30).show("talk")
    assert len(saved.token_ids) == len("hello\n") + 5
    lines = iter(["again", "/exit"])
    assert main(args) == 0
    assert "resumed session 'talk'" in capsys.readouterr().err
    assert len(DiskTier(tmp_path, 1 << 30).show("talk").token_ids) == 2 * (6 + 5)


def test_a_manifest_without_the_block_index_is_indexed_on_open(tmp_path):
    tier = DiskTier(tmp_path, 1 << 30)
    shared, own_a, own_b = b"shared" * 10, b"a" * 60, b"b" * 60
    tier.save("a", "fp", 8, 16, list(range(16)), [shared, own_a], 0)
    tier.save("b", "fp", 8, 16, list(range(16)), [shared, own_b], 0)
    tier.close()
    db = sqlite3.connect(tmp_path / "manifest.sqlite")
    db.execute("DROP TABLE session_blocks")  # as an older kvstack wrote it
    db.commit()
    db.close()
    tier = DiskTier(tmp_path, 1 << 30)
    tier.remove("a")
    assert {p.stem for p in tmp_path.rglob("*.blk")} == set(tier.show("b").blocks)
    assert tier.load("b", "fp")[1] == [shared, own_b]
