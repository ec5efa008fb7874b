"""Serving: continuous batching over a paged KV cache (`scheduler`) and an OpenAI-compatible HTTP server
(`server`, `python -m duo_jax.serve`)."""

from duo_jax.serve.scheduler import PagePool, Request, Scheduler, pages_for_memory

__all__ = ["PagePool", "Request", "Scheduler", "pages_for_memory"]
