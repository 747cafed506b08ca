"""The DeepSeek-V4 network in torch: dense reference, layers, weights, tiny checkpoints.

``load_reference`` is imported on first use, so pure-Python users of one of its modules do not
import torch.
"""

__all__ = ["load_reference"]


def __getattr__(name: str):
    if name == "load_reference":
        from dsv4ray.model.loader import load_reference

        return load_reference
    raise AttributeError(f"module 'dsv4ray.model' has no attribute {name!r}")
