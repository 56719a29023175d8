"""GPU/CPU workers: the model, the paged KV pool, attention, sampling. The only package that imports torch."""
