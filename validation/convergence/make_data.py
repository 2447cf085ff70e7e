"""Byte-level GPT pretraining data from the running interpreter's standard library sources.

    python -m validation.convergence.make_data OUTDIR [--max-bytes N] [--prefix NAME]

Text: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (the interpreter's own standard
library directory), recursively, except directories named ``test``, ``tests``, ``idlelib``,
``turtledemo``, ``site-packages``, ``dist-packages`` and ``__pycache__``. One file is one
document. Files are ordered by the SHA-1 of their path relative to the stdlib directory, so that
Megatron's ``--split 95,5,0`` (a contiguous range of documents per split) draws a pseudo-random 5 %
of the files for validation; the same Python version gives the same data on every machine.

Tokens: the file's UTF-8 bytes are the token ids (0..255), followed by one end-of-document id 256.
That is Megatron's ``NullTokenizer`` with end-of-document 256:

- megatron-core 0.17.1: ``--tokenizer-type NullTokenizer --vocab-size 256`` (vocab_size = N + 1,
  eod = N);
- megatron-core 0.19.2: ``--tokenizer-type NullTokenizer --vocab-size 257`` (vocab_size = N,
  eod = N - 1).

Both pad the vocabulary to 384 (``--make-vocab-size-divisible-by 128``). Written with
megatron-core's own ``IndexedDatasetBuilder`` (uint16 tokens) as ``OUTDIR/PREFIX.bin`` and
``OUTDIR/PREFIX.idx``; a JSON summary goes to ``OUTDIR/PREFIX.json`` and to stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig

EOD = 256
EXCLUDED_DIRS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "dist-packages", "__pycache__"}


def stdlib_files(root: str) -> list[str]:
    """Relative paths of the stdlib's .py files, excluded directories pruned, in SHA-1 order."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                found.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(found, key=lambda p: hashlib.sha1(p.encode()).hexdigest())


def documents(root: str, files: list[str], max_bytes: int = 0) -> tuple[list[str], list[bytes]]:
    """The files' bytes (empty files skipped), stopping before max_bytes (0: no limit) is exceeded."""
    used, docs, total = [], [], 0
    for rel in files:
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        if not data:
            continue
        if max_bytes and total + len(data) > max_bytes:
            break
        used.append(rel)
        docs.append(data)
        total += len(data)
    return used, docs


def split_counts(n_docs: int, split=(95, 5, 0)) -> list[int]:
    """Documents per split as BlendedMegatronDatasetBuilder cuts them: [round(lo * n), round(hi * n))
    for each split's cumulative fraction range."""
    cum = [0.0]
    for s in split:
        cum.append(cum[-1] + s / sum(split))
    return [int(round(cum[i + 1] * n_docs)) - int(round(cum[i] * n_docs)) for i in range(len(split))]


def write(out_prefix: str, docs: list[bytes]) -> list[int]:
    """Write docs as byte tokens + EOD with megatron-core's IndexedDatasetBuilder; return token counts."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(out_prefix + ".bin", dtype=numpy.uint16)
    counts = []
    for data in docs:
        ids = numpy.frombuffer(data, dtype=numpy.uint8).astype(numpy.uint16)
        ids = numpy.append(ids, numpy.uint16(EOD))
        builder.add_document(ids, [len(ids)])
        counts.append(len(ids))
    builder.finalize(out_prefix + ".idx")
    return counts


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--prefix", default="stdlib_bytes")
    ap.add_argument("--max-bytes", type=int, default=0, help="stop before this many bytes of text (0: all)")
    ap.add_argument("--root", default=sysconfig.get_paths()["stdlib"], help="directory to read (default: the stdlib)")
    args = ap.parse_args(argv)

    files = stdlib_files(args.root)
    used, docs = documents(args.root, files, args.max_bytes)
    if not docs:
        raise SystemExit(f"no .py files under {args.root}")
    os.makedirs(args.outdir, exist_ok=True)
    prefix = os.path.join(args.outdir, args.prefix)
    counts = write(prefix, docs)
    n_train, n_valid, _ = split_counts(len(docs))
    summary = {
        "text": f"*.py sources under the stdlib directory {args.root} (excluding {sorted(EXCLUDED_DIRS)})",
        "python": sys.version.split()[0],
        "root": args.root,
        "files_found": len(files),
        "documents": len(docs),
        "bytes": sum(len(d) for d in docs),
        "tokens": sum(counts),
        "tokenization": "UTF-8 bytes as ids 0..255, end-of-document id 256 after each file",
        "split_95_5_0": {"train_documents": n_train, "valid_documents": n_valid,
                         "train_tokens": sum(counts[:n_train]), "valid_tokens": sum(counts[n_train:n_train + n_valid])},
        "prefix": prefix,
        "first_files": used[:5],
        "files_sha1": hashlib.sha1("\n".join(used).encode()).hexdigest(),
    }
    with open(prefix + ".json", "w") as f:
        json.dump(dict(summary, files=used), f, indent=1)
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
