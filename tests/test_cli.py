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
    assert main(["generate", *ENGINE, "--prompt", "x", "--speculative", "dspark"]) == 2
    assert "no DSpark draft layers" in capsys.readouterr().err


def test_generate_with_dspark_drafts(capsys):
    """--speculative dspark on a model with draft layers: the same greedy tokens."""
    dspark = ["--model", "tiny-v41-dspark", "--random-init", "--kv-budget", "16MiB",
              "--prompt", "def f():", "--max-tokens", "8", "--temperature", "0",
              "--ignore-eos", "--json"]
    assert main(["generate", *dspark]) == 0
    plain = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(["generate", *dspark, "--speculative", "dspark"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain


def test_chat_keeps_the_conversation_in_the_cache(capsys, monkeypatch):
    lines = iter(["hello", "/stats --json", "and again", "/nope", "/reset", "fresh start",
                  "/exit"])
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


def test_reading_commands_create_nothing_and_errors_name_what_is_wrong(tmp_path, capsys):
    missing = tmp_path / "typo"
    assert main(["session", "list", "--cache-dir", str(missing)]) == 0
    assert "no saved sessions" in capsys.readouterr().out
    assert main(["session", "show", "x", "--cache-dir", str(missing)]) == 2
    assert "holds no saved sessions" in capsys.readouterr().err
    assert not missing.exists()
    bad = tmp_path / "prompt.txt"
    bad.write_bytes(b"\xff\xfe not text")
    assert main(["generate", "--model", "tiny", "--random-init", "--prompt-file",
                 str(bad)]) == 2
    assert f"prompt file {bad}: not UTF-8 text" in capsys.readouterr().err
    assert main(["demo", "--context", "99999"]) == 2
    assert "at most 32,720 tokens of prompt leave room for 48 new ones" in (
        capsys.readouterr().err)
    assert main(["generate", "--model", "tiny", "--random-init", "--prompt", "x",
                 "--device", "tpu"]) == 2
    assert "device 'tpu': not a device name" in capsys.readouterr().err


def test_a_conversation_at_the_model_length_says_what_to_do_or_keeps_its_last_tokens(
        capsys, monkeypatch):
    long_line = "x = 1; " * 120  # ~840 byte tokens, past tiny's 512
    lines = iter([long_line, "short", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", *ENGINE, "--max-tokens", "3", "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert "leaves no room under max_seq_len 512" in err and "--truncate left" in err
    # The refused turn left the conversation as it was: the next one is served.
    assert sum("tokens/s" in line for line in err.splitlines()) == 1
    lines = iter([long_line, long_line, "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", *ENGINE, "--max-tokens", "3", "--temperature", "0",
                 "--truncate", "left"]) == 0
    assert sum("tokens/s" in line for line in capsys.readouterr().err.splitlines()) == 2
    assert main(["generate", *ENGINE, "--max-tokens", "4", "--truncate", "left", "--json",
                 "--prompt", long_line]) == 0
    assert len(json.loads(capsys.readouterr().out)["prompt_token_ids"]) == 512 - 4


def test_chat_ctrl_c_stops_a_reply_and_leaves_at_the_prompt(capsys, monkeypatch, tmp_path):
    from kvstack.engine.session import Session

    real = Session.stream
    interrupted = []

    def stream(self, params=None):
        for i, out in enumerate(real(self, params)):
            if i == 1 and not interrupted:  # Ctrl-C while the first reply streams
                interrupted.append(True)
                raise KeyboardInterrupt
            yield out

    monkeypatch.setattr(Session, "stream", stream)
    answers = iter(["first", "/stats", "/stats --json", "second", KeyboardInterrupt])

    def fake_input(prompt=""):
        answer = next(answers)
        if answer is KeyboardInterrupt:
            raise KeyboardInterrupt
        return answer

    monkeypatch.setattr("builtins.input", fake_input)
    cache = ["--cache-dir", str(tmp_path)]
    assert main(["chat", *ENGINE, *cache, "--max-tokens", "4", "--temperature", "0",
                 "--session", "s"]) == 0
    err = capsys.readouterr().err
    assert "(reply stopped)" in err
    assert "conversation" in err and "bytes per token" in err  # the short table
    assert '"bytes_per_token"' in err  # and the whole report as JSON
    assert sum("tokens/s" in line for line in err.splitlines()) == 1  # the second turn
    # The stopped first turn was saved with the rest: resumed, it is all there.
    assert main(["session", "show", "s", "--json", *cache]) == 0
    saved = json.loads(capsys.readouterr().out)["tokens"]
    assert saved > len(b"first\nsecond\n") + 4
    # Resumed, the chat shows where the conversation stopped; /reset removes the saved one.
    answers = iter(["/reset", "/exit"])
    assert main(["chat", *ENGINE, *cache, "--session", "s"]) == 0
    err = capsys.readouterr().err
    assert "resumed session 's'" in err and "ending …" in err
    assert "saved session 's' removed" in err
    assert main(["session", "list", *cache]) == 0
    assert f"no saved sessions in {tmp_path}" in capsys.readouterr().out


def test_the_bundled_model_takes_a_20k_token_prompt(tmp_path, capsys):
    import inspect

    prompt = tmp_path / "long.py"
    prompt.write_text(inspect.getsource(inspect)[:72_000])  # ~21K tokens
    assert main(["generate", "--prompt-file", str(prompt), "--max-tokens", "2",
                 "--temperature", "0", "--json", "--kv-budget", "64MiB"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["prompt_token_ids"]) > 20_000 and len(out["token_ids"]) == 2


def test_typing_during_a_reply_is_not_echoed_nor_kept():
    import os
    import termios

    from kvstack.cli.chat import typing_hidden

    controller, terminal = os.openpty()
    with os.fdopen(terminal, "rb", buffering=0) as tty:
        assert termios.tcgetattr(terminal)[3] & termios.ECHO
        with typing_hidden(tty):
            assert not termios.tcgetattr(terminal)[3] & termios.ECHO
            os.write(controller, b"typed ahead\n")
        assert termios.tcgetattr(terminal)[3] & termios.ECHO  # restored
        os.write(controller, b"next\n")
        assert tty.readline() == b"next\n"  # what was typed during the reply is gone
    os.close(controller)
    with typing_hidden(io.StringIO()):  # not a terminal: nothing to do
        pass


def test_chat_reads_a_piped_conversation():
    """Lines from a pipe, not a terminal: no terminal settings to change, a reply each."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "kvstack.cli", "chat", *ENGINE,
                           "--max-tokens", "3", "--temperature", "0"],
                          input="hello\nagain\n/exit\n", capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_chat_in_a_terminal_ctrl_c_stops_the_reply_and_ctrl_d_leaves():
    """A real pseudo-terminal: Ctrl-C is the terminal's SIGINT to the chat, sent while a
    reply streams; the prompt comes back, and Ctrl-D there leaves with status 0."""
    import os
    import pty
    import select
    import signal
    import sys
    import time

    pid, terminal = pty.fork()
    if pid == 0:  # the child: the chat, with the pseudo-terminal as its terminal
        # As a terminal's shell starts a command: SIGINT to its default. A suite started in
        # the background of a script runs with SIGINT ignored, and exec keeps that.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execv(sys.executable, [sys.executable, "-m", "kvstack.cli", "chat", *ENGINE,
                                  "--max-tokens", "400", "--ignore-eos"])
    seen = b""

    def read_until(marker: bytes, after: int = 0) -> int:
        """Read until marker appears past offset `after`; where it ends."""
        nonlocal seen
        end = time.monotonic() + 120
        while (at := seen.find(marker, after)) < 0:
            assert time.monotonic() < end, f"no {marker!r} in {seen[-2000:]!r}"
            if select.select([terminal], [], [], 0.5)[0]:
                seen += os.read(terminal, 65536)
        return at + len(marker)

    try:
        read_until(b"> ")
        os.write(terminal, b"def f():\r")
        streaming = read_until(b"def f():\r\n")
        while len(seen) < streaming + 8:  # the reply is under way
            if select.select([terminal], [], [], 0.5)[0]:
                seen += os.read(terminal, 65536)
        os.write(terminal, b"\x03")  # Ctrl-C
        read_until(b"> ", read_until(b"reply stopped"))
        os.write(terminal, b"\x04")  # Ctrl-D at the prompt
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(terminal)
    assert os.waitstatus_to_exitcode(status) == 0
    assert b"Traceback" not in seen


def test_a_source_tree_not_installed_runs_the_command(tmp_path):
    """With the checkout on PYTHONPATH and no package metadata (a machine the package was
    never installed on), the parser still builds and names where the version went."""
    import subprocess
    import sys

    script = ("import importlib.metadata as m\n"
              "def missing(name): raise m.PackageNotFoundError(name)\n"
              "m.version = missing\n"
              "from kvstack.cli import main\n"
              "main(['--version'])\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0 and "not installed" in done.stdout


def test_each_engine_option_sets_its_config_field():
    from kvstack.cli import build_parser
    from kvstack.cli.engine_args import engine_config
    from kvstack.engine.config import EngineConfig

    args = build_parser().parse_args(["generate", "--kv-budget", "2GiB", "--compile",
                                      "--parallel-timeout", "5", "--host-budget", "1MiB"])
    config = engine_config(args, max_num_seqs=3)
    assert (config.kv_budget, config.compile_decode, config.parallel_timeout_s,
            config.host_budget, config.max_num_seqs) == ("2GiB", True, 5.0, "1MiB", 3)
    # An option left out is the config's own default.
    assert engine_config(build_parser().parse_args(["chat"])) == EngineConfig()
    # but for the server's step, smaller than offline generation's
    from kvstack.cli.serve import SERVE_MAX_NUM_BATCHED_TOKENS

    serve = engine_config(build_parser().parse_args(["serve"]))
    assert serve.max_num_batched_tokens == SERVE_MAX_NUM_BATCHED_TOKENS
    assert EngineConfig().max_num_batched_tokens > SERVE_MAX_NUM_BATCHED_TOKENS
    args = build_parser().parse_args(["serve", "--max-num-batched-tokens", "900"])
    assert engine_config(args).max_num_batched_tokens == 900
