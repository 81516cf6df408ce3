"""fsdp_core: a readable FSDP engine on torch.distributed collectives."""

__all__: list[str] = []
