"""What users call: LLM, AsyncEngine, the OpenAI server and its Serve app, batch jobs, the CLI."""
