"""The batcher: scheduling, the KV block table, dispatch to workers. Never imports torch."""
