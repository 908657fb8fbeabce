"""Kill engines while they save sessions on one shared cache directory; then check that
nothing was lost.

Several worker processes, each an `LLM` on the same `--cache-dir`, resume, extend and save
sessions from one pool of names (every session starts with the same system prompt, so
their first block files are shared between them) and remove some. The supervisor SIGKILLs
a random worker at random moments, mid-save included, and starts a new one, until it has
killed `--kills` of them. Then it stops the rest and checks, in a fresh engine:

- every session the manifest lists is intact (none listed as damaged) and loads;
- each continues token for token as a session that never paused (exact replay): the same
  greedy tokens as a reference engine given the session's token ids in one go;
- no block file is left that no session or prefix entry names.

    python bench/stress_sessions.py [--kills 100] [--workers 4] [--interval 1.2]
        [--disk-prefix-cache] [--cache-dir DIR]

Prints one line per kill and a summary; exits 1 if anything was lost.
"""

import argparse
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import time

NAMES = [f"agent-{i}" for i in range(12)]
SYSTEM = list(range(1, 33))  # four full blocks of 8 that every session shares
GREEDY_TOKENS = 6


def engine(cache_dir: str, **settings):
    from kvstack import LLM

    settings = {"kv_budget": "4MiB", "replay": "exact", "block_tokens": 8} | settings
    return LLM("tiny", random_init=True, seed=0, cache_dir=cache_dir, **settings)


def worker(cache_dir: str, seed: int, disk_prefix_cache: bool) -> None:
    """Forever: pick a session, resume or start it, add a turn, save; sometimes remove."""
    from kvstack import SamplingParams

    rng = random.Random(seed)
    llm = engine(cache_dir, disk_prefix_cache=disk_prefix_cache)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    print("ready", flush=True)  # killed from here on: a kill while loading proves little
    while True:
        name = rng.choice(NAMES)
        if rng.random() < 0.03:
            if llm.disk.has(name):
                llm.disk.remove(name)
            continue
        try:
            session = llm.resume(name) if llm.disk.has(name) else llm.session(name)
        except ValueError as e:
            if "no saved session" not in str(e):
                raise  # anything but another worker's removal in between is a fault
            continue
        if not session.token_ids:
            session.append(SYSTEM)
        session.append([rng.randrange(40, 500) for _ in range(rng.randrange(3, 20))])
        session.generate(params)
        if len(session.token_ids) > 400:  # stay well inside the tiny model's context
            session.close()
            llm.disk.remove(name)
            continue
        session.save()
        print("saved", flush=True)
        session.close()


def check(cache_dir: str) -> list[str]:
    """What was lost, as sentences; empty when nothing was."""
    from kvstack import SamplingParams
    from kvstack.cache.disk import DamagedSession

    problems = []
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True)
    llm = engine(cache_dir, enable_prefix_caching=False)
    reference = engine(tempfile.mkdtemp(), enable_prefix_caching=False)
    listed = llm.disk.sessions()
    for saved in listed:
        if isinstance(saved, DamagedSession):
            problems.append(f"session {saved.name!r} is listed as damaged: {saved.reason}")
            continue
        try:
            resumed = llm.resume(saved.name)
        except ValueError as e:
            problems.append(f"session {saved.name!r} does not load: {e}")
            continue
        expected = reference.session(saved.name)
        expected.append(saved.token_ids)
        if resumed.generate(params).token_ids != expected.generate(params).token_ids:
            problems.append(f"session {saved.name!r} does not continue token for token")
        resumed.close()
        expected.close()
    llm.disk._collect_garbage()
    unnamed = llm.disk._unnamed_files()
    if unnamed:
        problems.append(f"{len(unnamed)} block files no session or prefix entry names")
    print(f"checked {len(listed)} sessions in {cache_dir}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--cache-dir", help="default: a new temporary directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--interval", type=float, default=1.2,
                        help="mean seconds between kills (a busy machine needs more)")
    parser.add_argument("--disk-prefix-cache", action="store_true",
                        help="the workers also write every named block through to the "
                        "directory's prefix cache, which they then share")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)  # DIR SEED PREFIX: one
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.worker[2] == "1")
        return 0
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="kvstack-stress-")
    rng = random.Random(args.seed)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    started = 0

    def start() -> subprocess.Popen:
        nonlocal started
        started += 1
        return subprocess.Popen([sys.executable, __file__, "--worker", cache_dir,
                                 str(args.seed * 1000 + started),
                                 str(int(args.disk_prefix_cache))], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    workers = [start() for _ in range(args.workers)]
    ready: set[int] = set()
    t0, kill, saves = time.monotonic(), 0, 0
    while kill < args.kills:
        time.sleep(rng.uniform(0.25, 1.75) * args.interval)
        for w in workers:
            if w.poll() is not None:
                print(f"a worker exited by itself with {w.returncode}: a fault, not a kill")
                return 1
            while select.select([w.stdout], [], [], 0)[0]:
                line = w.stdout.readline().strip()
                if not line:
                    break
                ready.add(w.pid)
                saves += line == "saved"
        candidates = [i for i, w in enumerate(workers) if w.pid in ready]
        if not candidates:
            continue
        victim = rng.choice(candidates)
        workers[victim].send_signal(signal.SIGKILL)
        workers[victim].wait()
        workers[victim] = start()
        kill += 1
        print(f"kill {kill}/{args.kills} at {time.monotonic() - t0:.0f} s, {saves} saves so far")
    for w in workers:
        w.send_signal(signal.SIGKILL)
        w.wait()
    problems = check(cache_dir)
    for p in problems:
        print("LOST:", p)
    print(f"{args.kills} SIGKILLs of {args.workers} engines on one directory, {saves} saves "
          f"completed: {'nothing lost' if not problems else f'{len(problems)} problems'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
