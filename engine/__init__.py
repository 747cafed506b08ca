"""The control plane in pure Python (no torch, Ray or HTTP): configs, requests, plans, the
scheduler and its KV manager, output processing and EngineCore over a Pipeline; pd/ holds
prefill/decode disaggregation's planning, scheduler and cores."""
