"""The OpenAI-compatible HTTP layer: protocol models, response formatting, server, metrics."""
