"""What is installed: versions read from metadata or from already-imported modules.

Nothing here imports torch, TE or megatron: metadata is read from dist-info files, and a
module's own version is only read when that module is already in ``sys.modules``.
"""

from __future__ import annotations

import logging
import os
import sys

from . import release_data

# Other distribution names a component ships under (TE under several).
_ALSO_NAMED: dict[str, tuple[str, ...]] = {
    "megatron-core": ("megatron_core",),
    "megatron-fsdp": ("megatron_fsdp",),
    "transformer-engine": ("transformer_engine", "transformer-engine-torch", "transformer_engine_torch",
                           "transformer-engine-cu12", "transformer-engine-cu13"),
    "nemo-toolkit": ("nemo_toolkit",),
}

# The components whose versions are reported, each with the distribution names to try (first
# found wins): those whose versions key the targets' tables (gemm_patch/engine/releases.json), then
# torch (the GEMM) and apex (what apex-wgrad stands in for).
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    name: (name, *_ALSO_NAMED.get(name, ())) for name in (*release_data.distributions(), "torch", "apex")}

# A module whose __version__ beats metadata when it is already imported: a source checkout on
# PYTHONPATH shadows whatever pip installed, and the code that runs is what counts.
_VERSION_MODULES = {
    "megatron-core": "megatron.core.package_info",
    "transformer-engine": "transformer_engine",
    "torch": "torch",
}


def distribution_version(component: str) -> str | None:
    module = sys.modules.get(_VERSION_MODULES.get(component, ""))
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        return version
    from importlib import metadata  # ~10 ms of imports (email, zipfile, csv): only when asked

    for name in DISTRIBUTIONS.get(component, (component,)):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None




def installed_versions() -> dict[str, str | None]:
    return {name: distribution_version(name) for name in DISTRIBUTIONS}


# The launchers' global-rank variables, most specific first: torchrun, Slurm, Open MPI, MPICH/PMI.
RANK_VARIABLES = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_unparsable: set[tuple[str, str]] = set()  # reported once each


def process_rank() -> int | None:
    """The launcher-assigned global rank (torchrun, Slurm, MPI); 0 when none is set; None when
    it is not known. Callers compare with 0, so an unknown rank logs as a non-zero rank does:
    a summary line missing from one rank's output beats one repeated on every rank.

    The first variable of ``RANK_VARIABLES`` that is set (not blank) decides. Its value must be
    ASCII digits after stripping whitespace (``' 3 '`` is 3); anything else (``'x'``, ``'-1'``,
    ``'²'``, which ``str.isdigit`` accepts and ``int`` refuses) makes the rank unknown, logged
    once at DEBUG; this never raises, since it runs while megatron is being imported. A later
    variable is not consulted then: under torchrun inside Slurm, ``SLURM_PROCID`` numbers the
    Slurm tasks, not the ranks, so it cannot stand in for a broken ``RANK``.

    With none of them set, ``LOCAL_RANK`` counts as the rank: some single-node launchers and
    hand-written spawn scripts set only it, and treating it as unset made every process log the
    summary line at INFO. A non-zero local rank is never global rank 0 under any launcher; a zero
    one is rank 0 on a single node, and on several nodes costs at most one line per node.
    Nothing set at all: a single process, rank 0."""
    for var in (*RANK_VARIABLES, "LOCAL_RANK"):
        value = os.environ.get(var)
        if value is None or not value.strip():
            continue
        digits = value.strip()
        if digits.isascii() and digits.isdigit():
            return int(digits)
        if (var, value) not in _unparsable:
            _unparsable.add((var, value))
            logging.getLogger("gemm_patch").debug(
                "%s=%r is not a rank (ASCII digits); this process logs as a rank other than 0 does",
                var, value)
        return None
    return 0
