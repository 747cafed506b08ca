"""Sampling on the last stage: the batched sampling pass, the sampling controls applied to the
logits before it, and structured output's grammar masks."""
