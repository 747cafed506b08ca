"""dsv4ray: serve DeepSeek-V4-class models on Ray.

Public API (names other code relies on): ``LLM``, ``SamplingParams``, ``RequestOutput``.
The engine arrives with the paged engine; until then the package exposes the configuration and
the reference network (``dsv4ray.config``, ``dsv4ray.model``).
"""

__version__ = "0.1.0"
