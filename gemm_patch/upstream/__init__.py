"""What several targets know about the upstream code they patch: Megatron-FSDP's parameter rules
(``fsdp_rules``) and the pinned Megatron-LM main commit (``megatron_main``)."""
