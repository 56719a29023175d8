"""`laneserve simulate`: the simulator, a tool that replays traces through the real scheduler in simulated time.

engine.py runs a trace (the event loop, stand-in workers, cost model, results); cli.py is the command line
(`python -m batcher.sim` or `laneserve simulate`). The batcher's runtime modules never import this package.
"""
