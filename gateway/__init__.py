"""The OpenAI-compatible HTTP front: validation, tokenization, SSE. Never imports torch."""
