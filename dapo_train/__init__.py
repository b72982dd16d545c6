"""dapo-train: a single-GPU DAPO trainer (arXiv 2503.14476) for math reasoning with rule rewards."""

__version__ = "0.1.0"
