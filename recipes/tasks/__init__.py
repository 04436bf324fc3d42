"""The built-in tasks both GRPO recipes and the reward recipe train on offline, each with its data, its reward and its
tiny model (scripts/build_tiny_models.py): :mod:`recipes.tasks.synthetic` (reviews scored by an oracle),
:mod:`recipes.tasks.arithmetic` (sums checked against their solution), :mod:`recipes.tasks.calculator` (products, with a
multiply tool). Configs name their functions by dotted path (``recipes.tasks.calculator.multiply``)."""
