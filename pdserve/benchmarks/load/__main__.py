"""`python -m pdserve.benchmarks.load`: the same as `pdserve bench`."""

import sys

from pdserve.benchmarks.load.cli import main

sys.exit(main())
