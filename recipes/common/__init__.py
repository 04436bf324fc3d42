"""Building blocks shared by the recipes: the synthetic task, model loading, data sources, logging, checkpoints."""
