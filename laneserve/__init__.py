"""laneserve: the command line and the process launcher; the components live in gateway/, batcher/, workers/."""
