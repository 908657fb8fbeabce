"""The README is a front page that cannot rot: every shell and Python block in it runs, in
order, in one scratch directory, except the few marked `<!-- not run: why -->` (listed
below); its contents list points at its own sections; it stays short."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"

# The blocks that are not run, by their first line, and why.
NOT_RUN = {
    "make demo   # creates .venv, installs everything, runs `kvstack demo` on the bundled model":
        "the suite itself is what `make test` runs",
    "kvstack serve --port 8000 --kv-budget 4GiB": "a long-running server (tests/test_serve.py)",
    "import openai": "needs that server",
}


def readme_blocks() -> list[tuple[str, str, str | None]]:
    """(language, code, reason it is not run or None) for each sh/python block."""
    lines = README.read_text().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        fence = re.fullmatch(r"```(sh|python)", lines[i])
        if fence is None:
            i += 1
            continue
        end = lines.index("```", i + 1)
        before = next((s for s in reversed(lines[:i]) if s.strip()), "")
        mark = re.fullmatch(r"<!-- not run: (.+) -->", before)
        blocks.append((fence[1], "\n".join(lines[i + 1:end]), mark and mark[1]))
        i = end + 1
    return blocks


RUN = [(lang, code) for lang, code, reason in readme_blocks() if reason is None]


def test_the_blocks_not_run_are_the_listed_ones():
    skipped = {code.split("\n")[0]: reason for _, code, reason in readme_blocks() if reason}
    assert set(skipped) == set(NOT_RUN)
    assert len(RUN) >= 8


def test_the_readme_is_a_front_page_with_a_working_contents_list():
    text = README.read_text()
    assert len(text.split("\n")) <= 300
    headings = re.findall(r"^## (.+)$", text, flags=re.M)
    anchors = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
    listed = re.findall(r"^- \[.+\]\(#(.+)\)$", text, flags=re.M)
    assert listed and set(listed) <= anchors
    assert set(anchors) - set(listed) <= {"contents"}
    for target in re.findall(r"\]\(((?:docs|kvstack)/[^)#]+)", text):
        assert (README.parent / target).exists(), target


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("readme")


@pytest.mark.parametrize("lang,code", RUN, ids=[c.split("\n")[0][:40] for _, c in RUN])
def test_a_readme_block_runs(lang: str, code: str, scratch: Path):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    command = [sys.executable, "-c", code] if lang == "python" else [
        "bash", "-euo", "pipefail", "-c", code]
    done = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"{code}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
