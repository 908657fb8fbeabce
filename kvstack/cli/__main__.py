"""`python -m kvstack.cli`: the command without its console script (torchrun runs it so)."""

import sys

from kvstack.cli import main

sys.exit(main())
