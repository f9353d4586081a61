"""`python -m batchgate`: the `batchgate` command without the console script."""

import sys

from batchgate.cli import main

sys.exit(main())
