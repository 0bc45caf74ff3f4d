"""infinigen_prep: converts Hugging Face checkpoints into InfiniGen bundles."""

from infinigen_rt import __version__

__all__ = ["__version__"]
