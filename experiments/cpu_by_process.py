"""CPU seconds by process while a command runs, grouped by process name and the head of its command line: where a
test run's CPU goes (the suite is CPU-bound on 2 cores, so a core-second saved is about half a second of wall time).

    python experiments/cpu_by_process.py -- pytest -q -p no:cacheprovider
    python experiments/cpu_by_process.py --top 40 -- bash .ci/slurm-tier

It samples /proc every ``--every`` seconds and counts each process's user+system time from its first to its last
sample (a process alive before the command counts only what it used meanwhile). A process that lives less than one
sampling interval is missed, so the total is a lower bound; the machine's busy time from /proc/stat is printed
beside it for comparison.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_and_name(pid: str) -> tuple[float, str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    comm, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICKS, f"{comm[:16]:16} {cmd[:70]}"


def _busy_s() -> float:
    """Core-seconds this machine has been busy since boot (every /proc/stat cpu field but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / TICKS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=0.5, help="seconds between samples (default 0.5)")
    parser.add_argument("--top", type=int, default=30, help="groups to print (default 30)")
    parser.add_argument("command", nargs="+", help="the command to run (after --)")
    args = parser.parse_args()
    if args.every <= 0 or args.top <= 0:
        parser.error(f"--every {args.every} and --top {args.top} must be > 0")
    first: dict[str, float] = {}
    last: dict[str, tuple[float, str]] = {}
    before = {p for p in os.listdir("/proc") if p.isdigit()}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for pid in os.listdir("/proc"):
                if pid.isdigit() and (seen := _cpu_and_name(pid)) is not None:
                    first.setdefault(pid, seen[0] if pid in before else 0.0)
                    last[pid] = (seen[0], last.get(pid, seen)[1])
            done.wait(args.every)

    busy, start = _busy_s(), time.monotonic()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    code = subprocess.call(args.command)
    done.set()
    sampler.join(timeout=30)
    wall, busy = time.monotonic() - start, _busy_s() - busy
    groups: Counter[str] = Counter()
    for pid, (cpu, name) in last.items():
        groups[name] += cpu - first[pid]
    print(f"\n{wall:.0f} s wall; machine busy {busy:.0f} core-s; sampled processes {sum(groups.values()):.0f} "
          f"CPU-s (exit {code})", file=sys.stderr)
    for name, cpu in groups.most_common(args.top):
        print(f"{cpu:7.1f}  {name}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
