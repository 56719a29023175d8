"""`python -m loadtest ...` is `laneserve loadtest ...`."""

import sys

from loadtest.cli import main

sys.exit(main())
