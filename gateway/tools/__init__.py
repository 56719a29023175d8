"""Gateway tools: bench.py measures the gateway alone against an instant batcher (`python -m gateway.tools.bench`).

The gateway's runtime modules never import this package.
"""
