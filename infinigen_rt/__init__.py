"""infinigen_rt: a lean runtime for InfiniGen bundles (never imports transformers)."""

__version__ = "0.1.0"
