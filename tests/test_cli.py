"""`kvstack generate` and `kvstack chat`."""

import io
import json

from kvstack.cli import main

ENGINE = ["--model", "tiny", "--random-init", "--kv-budget", "1MiB"]


def test_generate_uses_the_bundled_model_without_model(capsys):
    assert main(["generate", "--prompt", "import os\n", "--max-tokens", "4", "--temperature",
                 "0", "--kv-budget", "16MiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["memory"]["planned_bytes_per_token"] == 133.5 and out["token_ids"]


def test_generate_json(capsys):
    assert main(["generate", *ENGINE, "--prompt", "def f():", "--max-tokens", "4",
                 "--temperature", "0", "--ignore-eos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 4 and out["finish_reason"] == "length"
    assert out["prompt_token_ids"] == list(b"def f():")
    assert out["memory"]["bytes_per_token"] == out["memory"]["planned_bytes_per_token"]
    assert out["timings"]["time_to_first_token_s"] > 0


def test_generate_streams_text_and_reads_files_and_stdin(tmp_path, capsys, monkeypatch):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("import os\n")
    assert main(["generate", *ENGINE, "--prompt-file", str(prompt), "--max-tokens", "3",
                 "--seed", "1"]) == 0
    err = capsys.readouterr().err
    assert "tokens/s" in err and "B/token measured" in err
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin"))
    assert main(["generate", *ENGINE, "--max-tokens", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_token_ids"] == list(b"from stdin")


def test_generate_errors(tmp_path, capsys):
    assert main(["generate", *ENGINE, "--prompt-file", str(tmp_path / "missing.txt")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert "config.json is missing" in capsys.readouterr().err
    assert main(["generate", *ENGINE, "--prompt", "x", "--top-p", "2"]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err


def test_chat_keeps_the_conversation_in_the_cache(capsys, monkeypatch):
    lines = iter(["hello", "/stats", "and again", "/nope", "/reset", "fresh start", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", *ENGINE, "--max-tokens", "3", "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    turns = [line for line in err.splitlines() if "tokens/s" in line and "cache" in line]
    assert len(turns) == 3
    held = [int(t.split(" for ")[1].split(" tokens")[0].replace(",", "")) for t in turns]
    # Turn two extends turn one's cache; after /reset the cache starts over.
    assert held[1] > held[0] and held[2] < held[1]
    assert '"bytes_per_token"' in err and "unknown command /nope" in err


def test_the_command_and_the_config_start_without_torch_or_the_engine():
    import subprocess
    import sys

    script = ("import sys, kvstack.config, kvstack.plan, kvstack.cli, kvstack.formats; "
              "print(sorted(m for m in ('torch', 'kvstack.engine.llm', 'kvstack.model.model') "
              "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "[]"
    version = subprocess.run([sys.executable, "-m", "kvstack.cli", "--version"],
                             capture_output=True, text=True, check=True)
    assert version.stdout.startswith("kvstack 0.")
