"""Several data-parallel ranks on one GPU, for correctness runs only.

NCCL refuses two ranks of one host on one GPU ("Duplicate GPU detected") but tells hosts apart by
``NCCL_HOSTID``: give every rank its own host id and they share the GPU, talking through NCCL's
socket transport over loopback. The collectives, Megatron-FSDP's sharding and its reductions are
the real ones; the step time and the memory of such a run say nothing about multi-GPU speed or
about one rank's memory on its own GPU (every rank holds its own model state on the one GPU).
"""
