"""The Megatron-LM main commit whose code the targets' tables record (gemm_patch/engine/releases.json).

Main reports the coming release's version (megatron-core "0.20.0", megatron-fsdp "0.7.0rc0"),
which must never be mistaken for that release: its fingerprints are keyed ``main@<commit>``.
"""

from ..engine.release_data import main_commit

COMMIT = main_commit()
RELEASE = f"main@{COMMIT[:8]}"  # the key of main's line in a target's fingerprint table
