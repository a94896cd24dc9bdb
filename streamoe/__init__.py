"""streamoe: run MoE models larger than RAM inside a hard memory cap."""

__version__ = "0.1.0"
