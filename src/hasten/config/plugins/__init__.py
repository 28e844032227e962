"""Plugin dataclasses for sharded engines (FSDP2, DeepSpeed) and their launch-configuration converters."""
