"""The engine: what patches megatron and undoes it, knowing no target by name (the package hands
it the registry). ``target`` is the base every target is made on; ``patcher`` applies, reverts and
reports; ``config``, ``detection``, ``imports``, ``callsite``, ``report`` and ``release_data``
are what those two are built on. Imports nothing above it (targets, commands)."""
