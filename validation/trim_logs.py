"""Rewrite a committed log archive (tar.gz) smaller, keeping what a reader checks a record against.

    python -m validation.trim_logs ARCHIVE.tar.gz [...]

In every ``.log`` member, megatron's argument list (between its ``arguments`` and ``end of
arguments`` rulers: every resolved flag, printed once per run; the command line is in the run's
record) is replaced by one line saying so, and a warning line seen before in the same log (each rank
prints the same ones) is left out. Iteration lines, gemm-patch's lines, errors, tracebacks and every
other member (gradient-probe records, JSON) are kept as they are. Trimming a trimmed archive changes
nothing.
"""

from __future__ import annotations

import io
import re
import sys
import tarfile
from pathlib import Path

ARGS_START = re.compile(r"^-+ arguments -+$")
ARGS_END = re.compile(r"^-+ end of arguments -+$")
ARGS_LEFT_OUT = "[argument list left out: the command line is in the run's record]"
RANK = re.compile(r"\[rank\d+\]:?|rank \d+")


def _is_warning(line: str) -> bool:
    stripped = line.strip()
    return "Warning" in line or stripped.startswith(("warnings.warn", '"""'))


def trim_log(text: str) -> str:
    """The log without megatron's argument list and without repeated warning lines."""
    out: list[str] = []
    seen: set[str] = set()
    in_args = False
    for line in text.splitlines():
        if in_args:
            if ARGS_END.match(line.strip()):
                in_args = False
                out.append(line)
            continue
        if ARGS_START.match(line.strip()):
            in_args = True
            out += [line, ARGS_LEFT_OUT]
            continue
        if _is_warning(line):
            key = RANK.sub("", line)
            if key in seen:
                continue
            seen.add(key)
        out.append(line)
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def trim_archive(path: Path) -> tuple[int, int]:
    """Rewrite ``path`` in place; (bytes before, bytes after)."""
    before = path.stat().st_size
    members: list[tuple[tarfile.TarInfo, bytes | None]] = []
    with tarfile.open(path, "r:gz") as tar:
        for info in tar.getmembers():
            data = tar.extractfile(info).read() if info.isfile() else None
            if data is not None and info.name.endswith(".log"):
                data = trim_log(data.decode("utf-8", "replace")).encode()
            members.append((info, data))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    path.write_bytes(buffer.getvalue())
    return before, path.stat().st_size


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print("usage: python -m validation.trim_logs ARCHIVE.tar.gz [...]", file=sys.stderr)
        return 2
    for path in paths:
        if not path.name.endswith(".tar.gz") or not path.is_file():
            print(f"trim_logs: {path} is not a .tar.gz file", file=sys.stderr)
            return 2
        before, after = trim_archive(path)
        print(f"{path}: {before} -> {after} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
