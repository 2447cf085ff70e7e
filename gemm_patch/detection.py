"""What is installed: versions read from metadata or from already-imported modules.

Nothing here imports torch, TE or megatron: metadata is read from dist-info files, and a
module's own version is only read when that module is already in ``sys.modules``.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata

# Distribution names to try per component, first found wins (TE ships under several names).
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "megatron-core": ("megatron-core", "megatron_core"),
    "megatron-fsdp": ("megatron-fsdp", "megatron_fsdp"),
    "transformer-engine": ("transformer-engine", "transformer_engine", "transformer-engine-torch",
                           "transformer_engine_torch", "transformer-engine-cu12",
                           "transformer-engine-cu13"),
    "torch": ("torch",),
    "nemo-toolkit": ("nemo-toolkit", "nemo_toolkit"),
    "apex": ("apex",),
}

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
    for name in DISTRIBUTIONS.get(component, (component,)):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def installed_versions() -> dict[str, str | None]:
    return {name: distribution_version(name) for name in DISTRIBUTIONS}


def process_rank() -> int:
    """The launcher-assigned global rank (torchrun, Slurm, MPI), 0 when none is set."""
    for var in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        value = os.environ.get(var)
        if value and value.strip().isdigit():
            return int(value)
    return 0
