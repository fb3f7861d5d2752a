"""``python -m smp_partition``: the command line."""

import sys

from smp_partition.cli import main

sys.exit(main())
