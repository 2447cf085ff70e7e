"""validation/convergence/make_data.py: byte tokens + end-of-document id written with megatron-core's
IndexedDatasetBuilder read back with its IndexedDataset (a subprocess with an installed release under
compat/.cache/ on PYTHONPATH; skipped when none is installed), the directory filter and SHA-1 order,
and the document split as BlendedMegatronDatasetBuilder cuts ``--split 95,5,0``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from validation.convergence import make_data

ROOT = Path(__file__).resolve().parents[2]
CONV = ROOT / "validation" / "convergence"

RELEASES = ("0.19.2", "0.17.1", "0.16.1")

DOCS = {
    "a.py": '"""Module a."""\nx = 1\n',
    "pkg/b.py": "def f():\n    return 'b'\n",
    "pkg/c.py": "# caf\u00e9\n",
    "empty.py": "",
    "test/t.py": "skipped\n",
    "pkg/__pycache__/c.py": "skipped\n",
    "notes.txt": "not python\n",
}

READBACK = r"""
import json, sys
from megatron.core.datasets.indexed_dataset import IndexedDataset
ds = IndexedDataset(sys.argv[1])
print("RESULT" + json.dumps({"n": len(ds), "docs": [ds[i].tolist() for i in range(len(ds))],
                             "dtype": str(ds[0].dtype), "doc_idx": ds.document_indices.tolist()}))
"""


def _tree(tmp_path: Path) -> Path:
    root = tmp_path / "lib"
    for rel, text in DOCS.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    return root


def _release_tree() -> Path:
    """A megatron-core release under compat/.cache/: one the matrix installed, else 0.16.1
    installed now (compat/matrix.py ``ensure_release``, under the matrix's lock)."""
    for rel in RELEASES:
        tree = ROOT / "compat" / ".cache" / f"mcore-{rel}"
        if (tree / "megatron" / "core" / "datasets" / "indexed_dataset.py").exists():
            return tree
    from compat import matrix

    return matrix.ensure_release(matrix.select(["megatron-core==0.16.1"])[0])


def test_files_filtered_and_in_sha1_order(tmp_path):
    root = _tree(tmp_path)
    files = make_data.stdlib_files(str(root))
    assert sorted(files) == ["a.py", "empty.py", os.path.join("pkg", "b.py"), os.path.join("pkg", "c.py")]
    assert files == make_data.stdlib_files(str(root))  # deterministic
    used, docs = make_data.documents(str(root), files)
    assert "empty.py" not in used and len(docs) == 3
    used, docs = make_data.documents(str(root), files, max_bytes=len(DOCS["a.py"]) + 1)
    assert sum(len(d) for d in docs) <= len(DOCS["a.py"]) + 1


@pytest.mark.parametrize("n", [1, 3, 20, 650, 653])
def test_split_matches_megatron(n):
    train, valid, test = make_data.split_counts(n)
    assert (train, valid, test) == (int(round(0.95 * n)), n - int(round(0.95 * n)), 0)


def test_written_with_megatron_and_read_back(tmp_path):
    tree = _release_tree()
    root = _tree(tmp_path)
    out = tmp_path / "data"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, str(CONV / "make_data.py"), str(out), "--root", str(root)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert summary["documents"] == 3 and summary["files_found"] == 4
    files = json.loads((out / "stdlib_bytes.json").read_text())["files"]
    expected = [list((root / f).read_bytes()) + [make_data.EOD] for f in files]
    assert summary["tokens"] == sum(len(e) for e in expected)
    proc = subprocess.run([sys.executable, "-c", READBACK, str(out / "stdlib_bytes")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout[proc.stdout.index("RESULT") + 6:])
    assert got["n"] == 3 and got["dtype"] == "uint16" and got["doc_idx"] == [0, 1, 2, 3]
    assert got["docs"] == expected
    assert max(max(d) for d in got["docs"]) == 256  # end-of-document id; bytes are 0..255
