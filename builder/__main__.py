"""`python -m builder ARGS`: the same command line as `build.py ARGS` (also from a regular install)."""

import sys

from builder.cli.main import main

sys.exit(main())
