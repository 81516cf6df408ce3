"""What the wrapper door (``fsdp_core.fully_sharded_data_parallel``, kept at torch's public path)
uses beside the engine: its argument checks and groups (``args``), ``summon_full_params``
(``full_params``) and gradient norm clipping over all shards (``clip_grad``)."""
