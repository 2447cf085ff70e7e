"""How ``gemm-patch compare`` runs one training command: in a process group of its own, its
output (stdout and stderr) written straight into the run's log file, which compare follows for
progress. Nothing compare does can block on the command's output: compare waits for the command's
own process, then gives what is still writing a bounded time (``DRAIN_SECONDS``) and ends the
processes left in the group (a sidecar holding the output, a stuck worker), saying so in the log.

SIGINT and SIGTERM to compare end every group it started (SIGTERM, then SIGKILL after
``KILL_AFTER_SECONDS``) and raise ``Interrupted`` with the signal's number.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

DRAIN_SECONDS = 2.0
KILL_AFTER_SECONDS = 10.0
POLL_SECONDS = 0.2


class Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_groups: list[int] = []  # the process groups started so far: ended on a signal


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def end_group(pgid: int) -> bool:
    """SIGTERM to every process of the group, SIGKILL to what is left after KILL_AFTER_SECONDS.
    True when something was still running."""
    if not _group_alive(pgid):
        return False
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + KILL_AFTER_SECONDS
    while time.monotonic() < deadline and _group_alive(pgid):
        time.sleep(POLL_SECONDS)
    if _group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return True


@contextmanager
def signals_end_runs() -> Iterator[None]:
    """While inside: SIGINT/SIGTERM end every group started and raise Interrupted."""
    def handler(signum: int, frame: object) -> None:
        for pgid in _groups:
            end_group(pgid)
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def run_command(command: Sequence[str], env: Mapping[str, str], log_path: str,
                on_line: Callable[[str], None]) -> int:
    """Run ``command`` with its output into ``log_path``; ``on_line`` sees each complete line as it
    comes. Returns the exit status (127: not found, 126: cannot be started)."""
    with open(log_path, "w", encoding="utf-8", errors="replace") as out:
        try:
            proc = subprocess.Popen(list(command), env=dict(env), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        except FileNotFoundError:
            out.write(f"{command[0]}: command not found\n")
            return 127
        except OSError as exc:
            out.write(f"{command[0]}: {exc.strerror or exc}\n")
            return 126
    _groups.append(proc.pid)
    with open(log_path, encoding="utf-8", errors="replace") as follow:
        pending = ""

        def read() -> None:
            nonlocal pending
            pending += follow.read()
            *lines, pending = pending.split("\n")
            for line in lines:
                on_line(line)

        while proc.poll() is None:
            read()
            time.sleep(POLL_SECONDS)
        deadline = time.monotonic() + DRAIN_SECONDS
        while time.monotonic() < deadline and _group_alive(proc.pid):
            read()
            time.sleep(POLL_SECONDS)
        read()
    if end_group(proc.pid):
        with open(log_path, "a", encoding="utf-8") as out:
            out.write(f"[gemm-patch compare] the command exited with {proc.returncode}; processes it left "
                      f"running in its process group were ended {DRAIN_SECONDS:g} s later\n")
    return proc.returncode


def read_text(path: str) -> str:
    return Path(path).read_text(encoding="utf-8", errors="replace")
