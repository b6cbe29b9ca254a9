"""Training recipes built on optim_factory (entry point: recipes/train.py)."""
