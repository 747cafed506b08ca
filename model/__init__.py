"""The DeepSeek-V4 network in torch: dense reference, layers, weights, tiny checkpoints."""

from dsv4ray.model.loader import load_reference

__all__ = ["load_reference"]
