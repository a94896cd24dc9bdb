"""streamoe: run MoE models larger than RAM inside a hard memory cap."""

__version__ = "0.1.0"

from .runtime import nvml as _nvml  # noqa: E402 - before anything imports MLX, whose CUDA context the plan counts

_nvml.note_start()
