"""Start N ranks of one command on one GPU (correctness only: see the package's docstring).

    python -m validation.shared_gpu.launch --ranks 4 -- python3 validation/parity/train_gpt_fsdp.py ...

Each rank gets the variables ``torch.distributed``'s ``env://`` start reads (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), ``LOCAL_RANK=0`` (megatron and the harnesses
pick their device from it), its own ``NCCL_HOSTID`` and, unless set, ``OMP_NUM_THREADS=1`` (as
torchrun gives several processes on one host). When a rank fails, the others are stopped: a
collective would wait for it for good.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

# NCCL over loopback sockets: no InfiniBand, no NVLink SHARP (one GPU has no NVLink peer).
NCCL_ENV = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}
GRACE_S = 10.0  # how long the other ranks get to end by themselves after one fails


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(base: Mapping[str, str], rank: int, ranks: int, port: int, gpu: str = "0") -> dict[str, str]:
    """The environment of one rank: ``base`` plus what makes it rank ``rank`` of ``ranks`` on GPU ``gpu``."""
    env = dict(base)
    env.update(NCCL_ENV)
    # torchrun's default for several processes on one host: each rank's intra-op pool would
    # otherwise take every core, and the ranks already outnumber the cores.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES=gpu,
               NCCL_HOSTID=f"shared-gpu-rank-{rank}", PYTHONUNBUFFERED="1")
    return env


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the rank and whatever it started: its own process group
        except ProcessLookupError:
            pass
        proc.wait()


def launch(command: Sequence[str], ranks: int, *, env: Mapping[str, str] | None = None, port: int | None = None,
           cwd: str | None = None, log_dir: str | os.PathLike | None = None, timeout_s: float | None = None,
           gpu: str = "0") -> int:
    """Run ``command`` as ranks 0..ranks-1 on GPU ``gpu`` and wait for all of them.

    Returns 0 when every rank exits 0, 124 when ``timeout_s`` ran out, else the first non-zero
    exit status. With ``log_dir`` each rank's output goes to ``log_dir/rank<R>.log``, else to this
    process's own output."""
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    if not command:
        raise ValueError("no command to launch")
    port = port or free_port()
    base = os.environ if env is None else env
    logs = Path(log_dir) if log_dir is not None else None
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    files = []
    try:
        for rank in range(ranks):
            out = open(logs / f"rank{rank}.log", "w") if logs is not None else None  # noqa: SIM115
            if out is not None:
                files.append(out)
            procs.append(subprocess.Popen(list(command), env=rank_env(base, rank, ranks, port, gpu), cwd=cwd,
                                          stdout=out, stderr=subprocess.STDOUT if out else None,
                                          stdin=subprocess.DEVNULL, start_new_session=True))
        return _wait(procs, timeout_s)
    finally:
        for proc in procs:
            _stop(proc)
        for f in files:
            f.close()


def _wait(procs: list[subprocess.Popen], timeout_s: float | None) -> int:
    start = time.monotonic()
    failed_at, first_bad = None, 0
    while True:
        codes = [p.poll() for p in procs]
        bad = [c for c in codes if c not in (None, 0)]
        if bad and failed_at is None:
            failed_at, first_bad = time.monotonic(), bad[0]
        if all(c is not None for c in codes):
            return first_bad
        now = time.monotonic()
        if failed_at is not None and now - failed_at > GRACE_S:
            return first_bad
        if timeout_s is not None and now - start > timeout_s:
            return 124
        time.sleep(0.2)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, required=True, help="how many ranks share the GPU")
    p.add_argument("--gpu", default="0", help="the GPU they share (CUDA_VISIBLE_DEVICES of every rank)")
    p.add_argument("--port", type=int, default=None, help="MASTER_PORT (default: a free one)")
    p.add_argument("--log-dir", default=None, help="one log per rank here (default: this terminal)")
    p.add_argument("--timeout", type=float, default=None, help="seconds; then every rank is stopped (exit 124)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS ...]")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command after --")
    if args.ranks < 1:
        p.error(f"--ranks must be at least 1, got {args.ranks}")
    return launch(command, args.ranks, port=args.port, log_dir=args.log_dir, timeout_s=args.timeout, gpu=args.gpu)


if __name__ == "__main__":
    sys.exit(main())
