"""Parallel Context-of-Experts Decoding (PCED) for retrieval-augmented generation."""

__version__ = "0.1.0"
