"""dsv4ray: serve DeepSeek-V4-class models on Ray.

Public API: ``LLM``, ``SamplingParams``, ``RequestOutput`` (imported lazily, so the pure-Python
parts of the package, such as the scheduler, import without torch).
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "RequestMetrics"]

_EXPORTS = {
    "LLM": "dsv4ray.entrypoints.llm",
    "SamplingParams": "dsv4ray.engine.sampling",
    "RequestOutput": "dsv4ray.engine.outputs",
    "RequestMetrics": "dsv4ray.engine.outputs",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dsv4ray' has no attribute {name!r}")
