"""The OpenAI-compatible HTTP layer: request parsing and models, answers and SSE, the FastAPI app
over an engine client (``server.OpenAIServer(...).app``), who may call, and metrics."""
