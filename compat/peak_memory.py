"""The peak resident memory of each pytest process of a run.

As a pytest plugin (``-p compat.peak_memory`` from the repository root, ``-p peak_memory`` with
compat/ on the path, as the version matrix's release runs have it), a pytest process appends its
own peak, and that of the largest process it started, to the file PYTEST_PEAK_MEMORY_LOG names
(nothing where it is unset). .ci/run sets it, then says what was recorded:

    python compat/peak_memory.py LOG [--limit-gib 4] [--expect 2]

One line per pytest process started from outside pytest (the unit tests, the version matrix),
and one for the largest of the pytest runs each started (each release's tests). Exit 1 where any
went over the limit, or fewer than ``--expect`` were recorded (a process killed, for memory say,
ends without its line): a test that holds what it does not need (a whole folder's bytes) shows
here first.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 20  # KiB per GiB: ru_maxrss is in KiB on Linux


@dataclass(frozen=True)
class Process:
    pid: int
    parent: int
    peak_kib: int  # its own
    children_kib: int  # the largest process it waited for
    args: str

    def command(self) -> str:
        return f"pytest {self.args}".strip()


def pytest_unconfigure(config) -> None:
    log = os.environ.get("PYTEST_PEAK_MEMORY_LOG")
    if not log:
        return
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    args = " ".join(config.invocation_params.args).replace("\t", " ").replace("\n", " ")
    # one short write in append mode: the lines of processes ending together never interleave
    with open(log, "a") as handle:
        handle.write(f"{os.getpid()}\t{os.getppid()}\t{own}\t{children}\t{args}\n")


def read(log: Path) -> list[Process]:
    processes = []
    for line in log.read_text().splitlines():
        fields = line.split("\t")
        if len(fields) == 5:
            pid, parent, peak, children, args = fields
            processes.append(Process(int(pid), int(parent), int(peak), int(children), args))
    return processes


def gib(kib: int) -> str:
    return f"{kib / GIB:.2f} GiB"


def summary(processes: list[Process], limit_gib: float, expect: int = 0) -> tuple[list[str], bool]:
    """The lines to print, and whether every process stayed within the limit (and, with
    ``expect``, whether that many were started from outside pytest and recorded)."""
    pids = {p.pid for p in processes}
    top = [p for p in processes if p.parent not in pids]
    lines = [f"peak resident memory of each pytest process (limit {limit_gib:g} GiB):"]
    for process in top:
        lines.append(f"  {gib(process.peak_kib):>9}  {process.command()} "
                     f"(the largest process it started: {gib(process.children_kib)})")
        nested = [p for p in processes if p.parent == process.pid]
        if nested:
            largest = max(nested, key=lambda p: p.peak_kib)
            lines.append(f"  {gib(largest.peak_kib):>9}  the largest of the {len(nested)} pytest runs it started: "
                         f"{largest.command()}")
    over = [p for p in processes if p.peak_kib > limit_gib * GIB]
    lines += [f"  over {limit_gib:g} GiB: {gib(p.peak_kib)} {p.command()}" for p in over]
    missing = expect - len(top)
    if missing > 0 or not processes:
        # a process killed (for memory, say) ends without its line
        lines.append(f"  {max(missing, 1)} pytest process(es) recorded nothing: killed before the end?")
    return lines, not over and bool(processes) and missing <= 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--limit-gib", type=float, default=4.0)
    parser.add_argument("--expect", type=int, default=0, help="pytest processes started from outside pytest")
    args = parser.parse_args(argv)
    lines, ok = summary(read(args.log) if args.log.exists() else [], args.limit_gib, args.expect)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
