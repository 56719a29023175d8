"""Open-loop load testing of any OpenAI-compatible server. Imports nothing from gateway/, batcher/, workers/."""
