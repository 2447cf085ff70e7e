"""The ``gemm-patch`` command (``cli``) and what its subcommands run: ``demo``, ``doctor``,
``launcher`` (``run``) and ``compare``. The top layer: nothing in the package imports it."""
