"""What two or more recipes use: config checks, schema and resolvers, a run's start and finish, checkpoint folders,
metric loggers, model and data loading, the prompt table and stream, trl reward functions, text metrics, LoRA
settings, FSDP2 sharding, and TorchRL's chat stack (the built-in tasks: ``recipes.tasks``)."""
