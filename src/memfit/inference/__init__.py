"""Serving memory: how many requests of what length fit, for vLLM and transformers' continuous batching."""
