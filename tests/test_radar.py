"""compat/radar.py against a fake PyPI: JSON fixtures served by a monkeypatched fetch function
and by a local http.server, and an index that does not answer (one line, exit 0)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "compat"))
import radar  # noqa: E402


def _file(yanked: bool = False, reason: str | None = None) -> dict:
    return {"filename": "x.whl", "yanked": yanked, "yanked_reason": reason}


PYPI = {
    "megatron-core": {"releases": {
        "0.12.0": [_file()],  # older than the oldest recorded: counted
        "0.19.2": [_file()],  # recorded
        "0.19.1": [_file(True, "wrong version")],  # yanked
        "0.19.0rc1": [_file()],  # a pre-release of a version released since: counted
        "0.20.0": [_file()],  # unknown
        "0.21.0rc0": [_file()],  # a pre-release of a version not released yet: listed
    }},
    "megatron-fsdp": {"releases": {"0.6.1": [_file()]}},
    "transformer-engine": {"releases": {"2.20.2": [_file()], "2.21.0": [_file()]}},
    "transformer-engine-torch": {"releases": {"2.20.2": [_file()], "2.21.0": [_file()]}},
    "nemo-toolkit": {"releases": {"2.7.3": [_file()], "3.0.0": [_file()], "3.1.0": [_file()]}},
    "megatron-bridge": {"releases": {"0.6.2": [_file()], "0.7.0": [_file(), _file(True)]}},
}


def run(capsys, fetch) -> tuple[int, list[str]]:
    rc = radar.main([], fetch=fetch)
    return rc, capsys.readouterr().out.splitlines()


def line(lines: list[str], start: str) -> str:
    (found,) = [x.strip() for x in lines if x.strip().startswith(start)]
    return found


def test_lists_what_is_unknown_and_says_what_it_means(capsys):
    rc, lines = run(capsys, PYPI.__getitem__)
    assert rc == 0
    assert lines[0].startswith("radar: 6 release(s) on PyPI unknown to gemm-patch"), lines
    assert line(lines, "megatron-core 0.20.0:") == (
        "megatron-core 0.20.0: unknown to every target: gemm-patch leaves it alone until adopted "
        "(`python compat/adopt.py megatron-core==0.20.0`), unless its code is identical to a recorded "
        "release's (compatible)")
    assert line(lines, "nemo-toolkit 3.0.0").endswith(
        "has no nemo.lightning.megatron_parallel: nemo-fsdp-gaf not applicable (recorded)")
    assert "not in nemo-fsdp-gaf's table" in line(lines, "nemo-toolkit 3.1.0:")
    assert "not in te-dummy-wgrad's table" in line(lines, "transformer-engine 2.21.0:")
    te_torch = line(lines, "transformer-engine-torch 2.21.0:")
    assert "pairs with transformer-engine 2.21.0 (not recorded either)" in te_torch
    assert "validated: 0.6.2" in line(lines, "megatron-bridge 0.7.0:")  # one file yanked, not all
    # Every line but the head is indented: one block.
    assert all(x.startswith("  ") for x in lines[1:])


def test_known_releases_are_not_listed(capsys):
    _, lines = run(capsys, PYPI.__getitem__)
    text = "\n".join(lines)
    for known in ("megatron-core 0.19.2", "megatron-fsdp 0.6.1", "transformer-engine 2.20.2", "nemo-toolkit 2.7.3",
                  "megatron-bridge 0.6.2", "transformer-engine-torch 2.20.2"):
        assert known not in text


def test_marks_yanked_and_pre_releases(capsys):
    _, lines = run(capsys, PYPI.__getitem__)
    assert line(lines, "megatron-core 0.19.1") == \
        "megatron-core 0.19.1 [yanked: wrong version]: yanked on PyPI: nothing to adopt"
    pre = line(lines, "megatron-core 0.21.0rc0")
    assert pre.startswith("megatron-core 0.21.0rc0 [pre-release]: unknown to every target")
    assert pre.endswith("a pre-release: wait for the final release")
    assert line(lines, "megatron-core: 1 pre-release(s)").endswith("older than its newest final release not listed")
    assert line(lines, "megatron-core: 1 release(s) older than 0.13.0")


def test_known_reads_the_tables_and_the_new_matrix_key():
    known = radar.known()
    assert "0.19.2" in known.recorded["megatron-core"] and "0.6.1" in known.recorded["megatron-fsdp"]
    assert "2.20.2" in known.recorded["transformer-engine"] == known.recorded["transformer-engine-torch"] | {"2.20.2"}
    assert "2.7.3" in known.recorded["nemo-toolkit"]
    assert "0.6.2" in known.recorded["megatron-bridge"]
    assert known.not_applicable["nemo-toolkit"]["3.0.0"] == "has no nemo.lightning.megatron_parallel"
    assert not any(v.startswith("main@") for versions in known.recorded.values() for v in versions)


def test_everything_known_says_so(capsys):
    quiet = {name: {"releases": {}} for name in radar.PACKAGES}
    quiet["megatron-core"] = {"releases": {"0.19.2": [_file()]}}
    _, lines = run(capsys, quiet.__getitem__)
    assert lines[0].startswith("radar: every release on PyPI is known to gemm-patch")


# -- over HTTP ------------------------------------------------------------------------------------

class _FakePyPI(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        parts = self.path.strip("/").split("/")  # pypi/<name>/json
        name = parts[-2] if len(parts) >= 2 and parts[-1] == "json" else ""
        if name not in PYPI:
            self.send_error(404)
            return
        body = json.dumps(PYPI[name]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_pypi():
    server = HTTPServer(("127.0.0.1", 0), _FakePyPI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/pypi"
    server.shutdown()
    server.server_close()


def test_command_over_http(fake_pypi):
    out = subprocess.run([sys.executable, str(ROOT / "compat" / "radar.py"), "--index", fake_pypi],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].startswith("radar: 6 release(s)"), out.stdout
    assert "megatron-core 0.20.0: unknown to every target" in out.stdout


def test_a_missing_project_reads_as_no_release(fake_pypi):
    fetch = radar.pypi_fetch(fake_pypi, 5)
    assert fetch("no-such-project") == {"releases": {}}


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_offline_is_one_line_and_exit_0():
    index = f"http://127.0.0.1:{_closed_port()}/pypi"
    out = subprocess.run([sys.executable, str(ROOT / "compat" / "radar.py"), "--index", index, "--timeout", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert out.stderr == ""
    (only,) = out.stdout.splitlines()
    assert only.startswith("radar: PyPI not reachable (") and only.endswith(")"), only


def test_one_unreadable_project_after_the_first_is_one_line(capsys):
    def fetch(name):
        if name == "nemo-toolkit":
            raise radar.Unreachable("timed out")
        return PYPI[name]

    rc, lines = run(capsys, fetch)
    assert rc == 0
    assert line(lines, "nemo-toolkit:") == "nemo-toolkit: not read (timed out)"
