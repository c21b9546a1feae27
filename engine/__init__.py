"""pipecast engine: Megatron-compatible pipeline schedules, the pipeline runtime and the training recipe."""
