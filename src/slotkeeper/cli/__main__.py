"""`python -m slotkeeper.cli`: the same command line as the `slotkeeper` script."""

import sys

from slotkeeper.cli.commandline import main

sys.exit(main())
