"""validation.trim_logs: an archive loses megatron's argument list and repeated warnings, and
nothing a reader checks a record against."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from validation import trim_logs

LOG = """\
[gemm_patch] INFO: megatron-core 0.19.2: fsdp-wgrad verified
------------------------ arguments ------------------------
  accumulate_allreduce_grads_in_fp32 .............. False
  hidden_size ..................................... 2048
-------------------- end of arguments ---------------------
[rank0]: /x/y.py:426: SyntaxWarning: invalid escape sequence '\\-'
[rank1]: /x/y.py:426: SyntaxWarning: invalid escape sequence '\\-'
  warnings.warn(
  warnings.warn(
 [2026-12-05 08:47:01] iteration        1/       6 | lm loss: 6.377450E+00 | grad norm: 7.210 |
 [2026-12-05 08:47:08] iteration        2/       6 | lm loss: 6.378874E+00 | grad norm: 7.312 |
Traceback (most recent call last):
RuntimeError: something failed
"""


def _archive(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _read(path: Path) -> dict[str, bytes]:
    with tarfile.open(path, "r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_trim_log_keeps_iterations_gemm_patch_lines_and_errors():
    out = trim_logs.trim_log(LOG)
    assert "hidden_size" not in out and trim_logs.ARGS_LEFT_OUT in out
    assert out.count("SyntaxWarning") == 1 and out.count("warnings.warn(") == 1
    for kept in ("fsdp-wgrad verified", "iteration        1/", "iteration        2/", "Traceback",
                 "RuntimeError: something failed", "end of arguments"):
        assert kept in out, kept
    assert trim_logs.trim_log(out) == out


def test_archive_is_rewritten_with_other_members_unchanged(tmp_path):
    probe = b'{"rank": 0, "parameters": {"w": {"norm": 1.0}}}'
    path = tmp_path / "logs_case.tar.gz"
    _archive(path, {"case/fusion_on.log": LOG.encode(), "case/fusion_on.grad_probe/rank0.json": probe})
    assert trim_logs.main([str(path)]) == 0
    members = _read(path)
    assert members["case/fusion_on.grad_probe/rank0.json"] == probe
    assert members["case/fusion_on.log"].decode() == trim_logs.trim_log(LOG)


def test_what_is_not_an_archive_is_refused(tmp_path, capsys):
    log = tmp_path / "run.log"
    log.write_text(LOG)
    assert trim_logs.main([str(log)]) == 2
    assert "is not a .tar.gz file" in capsys.readouterr().err
    assert log.read_text() == LOG
