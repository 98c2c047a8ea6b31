"""`python -m speculant` runs the `speculant` command."""

import sys

from speculant.launch.cli import main

sys.exit(main())
