"""What both recipes use: config checks and resolvers, a run's start and finish, checkpoint folders, metric loggers,
model and data loading, LoRA settings, FSDP2 sharding, the synthetic task, and TorchRL's chat stack."""
