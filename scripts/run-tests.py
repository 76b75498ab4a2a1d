#!/usr/bin/env python3
"""Builds the test binaries cargo would run, then runs them side by side.

Most of walbox's test time is spent waiting on servers (PostgreSQL, brokers),
and every test binary starts its own, on free ports: binaries share nothing,
so several can run at once. Within a binary, tests run as cargo runs them
(threads of one process, so a binary can share a server between its tests).

    scripts/run-tests.py [-j JOBS] [--skip NAME ...] [--only NAME ...] [--threads NAME=N ...] -- CARGO_TEST_ARGS...

Each binary's output goes to a file and is printed whole when it ends (with
its time), longest-running binaries start first (times of the last run are
kept in target/test-times.json, seeded from scripts/test-times.json), and the exit code is 1 if any binary
failed. Arguments after `--` go to `cargo test` (e.g. `--workspace
--all-targets`); `--skip`/`--only` pick binaries by target name.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

TIMES = os.path.join(os.environ.get("CARGO_TARGET_DIR", "target"), "test-times.json")
# What a fresh checkout starts from: the times of a run on a machine of the
# kind CI runs on (2 cores), so that the longest binaries start first there too.
SEED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "test-times.json")


def binaries(cargo_args):
    """(name, kind, executable, package dir) of every test binary cargo builds."""
    cmd = ["cargo", "test", "--no-run", "--message-format=json-render-diagnostics"] + cargo_args
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        sys.exit(proc.returncode)
    out = []
    for line in proc.stdout.splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if msg.get("reason") != "compiler-artifact" or not msg.get("executable"):
            continue
        if not msg.get("profile", {}).get("test"):
            continue
        target = msg["target"]
        kind = target["kind"][0]
        name = target["name"] if kind != "lib" else target["name"] + " (lib)"
        if kind == "bin":
            name = target["name"] + " (bin)"
        package_dir = os.path.dirname(msg["manifest_path"])
        out.append((name, kind, msg["executable"], package_dir))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("-j", "--jobs", type=int, default=int(os.environ.get("WALBOX_TEST_JOBS", "3")))
    parser.add_argument("--skip", action="append", default=[])
    parser.add_argument("--only", action="append", default=[])
    parser.add_argument("--threads", action="append", default=[],
                        help="NAME=N: run binary NAME's tests N at a time (its tests wait on servers)")
    parser.add_argument("cargo_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    cargo_args = [a for a in args.cargo_args if a != "--"]
    # Arguments for the test binaries themselves (after a second `--`).
    test_args = []
    if "--" in args.cargo_args[1:]:
        i = args.cargo_args.index("--", 1)
        cargo_args = [a for a in args.cargo_args[:i] if a != "--"]
        test_args = args.cargo_args[i + 1:]

    found = binaries(cargo_args)
    bare = lambda n: n.split(" ")[0]
    found = [b for b in found if bare(b[0]) not in args.skip]
    if args.only:
        found = [b for b in found if bare(b[0]) in args.only]
    times = {}
    for path in (SEED, TIMES):
        try:
            with open(path) as f:
                times.update(json.load(f))
        except (OSError, ValueError):
            pass
    # Longest first, so the last to end is a short one.
    found.sort(key=lambda b: -times.get(b[0], 60.0))

    threads_of = dict(t.split("=", 1) for t in args.threads)

    lock = threading.Lock()
    queue = list(found)
    failed = []
    started = time.monotonic()

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                name, kind, exe, cwd = queue.pop(0)
            t0 = time.monotonic()
            with tempfile.TemporaryFile(mode="w+") as log:
                env = dict(os.environ)
                env.setdefault("RUST_BACKTRACE", "1")
                if bare(name) in threads_of:
                    env["RUST_TEST_THREADS"] = threads_of[bare(name)]
                rc = subprocess.call([exe] + test_args, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env)
                log.seek(0)
                text = log.read()
            took = time.monotonic() - t0
            with lock:
                times[name] = round(took, 1)
                status = "ok" if rc == 0 else f"FAILED (exit {rc})"
                print(f"==== {name}: {status} in {took:.0f} s ({exe})", flush=True)
                # A passing binary's summary lines; a failing one's whole output.
                if rc == 0:
                    for l in text.splitlines():
                        if l.startswith("test result:"):
                            print(l)
                else:
                    print(text)
                    failed.append(name)
                sys.stdout.flush()

    threads = [threading.Thread(target=worker) for _ in range(max(1, args.jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        os.makedirs(os.path.dirname(TIMES), exist_ok=True)
        with open(TIMES, "w") as f:
            json.dump(times, f, indent=1, sort_keys=True)
    except OSError:
        pass
    total = time.monotonic() - started
    print(f"==== {len(found)} test binaries in {total:.0f} s, {args.jobs} at a time; "
          f"{len(failed)} failed{': ' + ', '.join(failed) if failed else ''}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
