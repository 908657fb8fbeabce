"""docs/architecture.md's count of the files a decode step runs code in is measured, not
remembered: one traced decode step of the tiny model must touch exactly the files it lists."""
import re
import sys
from pathlib import Path

from kvstack import LLM, SamplingParams

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def test_the_files_a_decode_step_runs_are_the_ones_the_code_map_lists():
    paragraph = DOC.read_text().split("Counted by tracing one decode step", 1)[1]
    paragraph = paragraph.split("`kvstack generate` adds", 1)[0]
    count = int(re.search(r"runs code in (\d+)\s+files", paragraph)[1])
    listed = set(re.findall(r"`([a-z_/]+\.py)`", paragraph)) - {"tests/test_architecture.py"}
    assert len(listed) == count

    llm = LLM("tiny", random_init=True, kv_budget="16MiB")
    llm.add_request(list(range(1, 40)), SamplingParams(max_tokens=8, temperature=0))
    llm.core.step()  # the prefill
    llm.core.step()  # a first decode: whatever runs once is done
    package = Path(llm.__module__.replace(".", "/")).parts[0]
    touched = set()

    def profile(frame, event, arg):
        path = frame.f_code.co_filename.replace("\\", "/")
        if f"/{package}/" in path:
            touched.add(path.rsplit(f"/{package}/", 1)[1])

    sys.setprofile(profile)
    try:
        llm.core.step()
    finally:
        sys.setprofile(None)
    assert touched == listed
