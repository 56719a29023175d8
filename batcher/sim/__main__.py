"""`python -m batcher.sim`: the same as `laneserve simulate`."""

import sys

from batcher.sim.cli import main

sys.exit(main())
