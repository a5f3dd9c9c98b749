"""`python -m pdserve.benchmarks.load`: the same as `pdserve bench`."""

import sys

from pdserve.benchmarks.load.command import main

sys.exit(main())
