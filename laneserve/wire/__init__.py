"""The wire between the three processes: typed messages (protocol), sockets (transport, CURVE included).

Owned by none of the processes and used by all three; imports nothing of gateway/, batcher/ or workers/.
"""
