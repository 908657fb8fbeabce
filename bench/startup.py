"""Start-up time of `kvstack generate` and `kvstack serve` with their defaults, on the
bundled model: a first start on an empty cache folder (the C kernels are compiled then)
and `--starts - 1` second starts that find what the first one left.

`generate` is timed from launch to its exit after `--max-tokens` tokens of a short prompt
(so its figure includes the generation, a few hundredths of a second); `serve` from launch
to its first answer of `GET /health`, then stopped. Each start runs with
XDG_CACHE_HOME pointing at one temporary folder (where kvstack keeps its built kernels
and where torch keeps its compile caches), created empty for the first start; one
thread (`--threads 1`, OMP_NUM_THREADS=1). Prints each start's seconds and the ready
bar of 30 s beside them; `--json` for a machine-readable row.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

from serve import free_port, stop  # bench/ is on the path: the serving benchmark's helpers

BAR_S = 30.0  # the longest acceptable second start


def time_generate(env: dict[str, str], max_tokens: int) -> float:
    launched = time.perf_counter()
    subprocess.run([sys.executable, "-m", "kvstack.cli", "generate", "--threads", "1",
                    "--prompt", "The cache of a long document", "--max-tokens",
                    str(max_tokens)], env=env, check=True, capture_output=True)
    return time.perf_counter() - launched


def time_serve(env: dict[str, str], timeout_s: float = 300) -> float:
    port = free_port()
    launched = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "kvstack.cli", "serve", "--threads",
                                "1", "--port", str(port)], env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        while time.perf_counter() - launched < timeout_s:
            if process.poll() is not None:
                raise RuntimeError(f"kvstack serve exited: {process.stdout.read()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                return time.perf_counter() - launched
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"kvstack serve did not answer within {timeout_s} s")
    finally:
        stop(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=3,
                        help="starts of each command: one first start, the rest second")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.starts < 2:
        parser.error("--starts must be at least 2 (one first start and a second start)")
    rows = {"generate": [], "serve": []}
    for command in rows:
        with tempfile.TemporaryDirectory() as cache:
            env = os.environ | {"XDG_CACHE_HOME": cache, "OMP_NUM_THREADS": "1",
                                "TOKENIZERS_PARALLELISM": "false"}
            for _ in range(args.starts):
                rows[command].append(time_generate(env, args.max_tokens)
                                     if command == "generate" else time_serve(env))
    load = os.getloadavg()
    if args.json:
        print(json.dumps({"seconds": rows, "bar_s": BAR_S, "load": load, "args": vars(args)}))
        return
    print(f"{'command':<10} {'first start s':>14} {'second starts s':>20}   bar")
    for command, seconds in rows.items():
        later = seconds[1:]
        verdict = "met" if max(later) <= BAR_S else "NOT met"
        print(f"{command:<10} {seconds[0]:>14.1f} {', '.join(f'{s:.1f}' for s in later):>20}"
              f"   second start ≤ {BAR_S:.0f} s: {verdict}")
    print(f"bundled model, defaults, 1 thread; generate = launch to exit after "
          f"{args.max_tokens} tokens, serve = launch to the first answer of /health; "
          f"load average {' '.join(f'{x:.2f}' for x in load)}")


if __name__ == "__main__":
    main()
