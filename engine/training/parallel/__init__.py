"""Parallelism of the training recipe: data-parallel gradient sync, ZeRO-1, FSDP2, tensor parallelism."""
