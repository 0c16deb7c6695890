#!/usr/bin/env python3
"""pt-multi-gpu: build multi-GPU PyTorch images from images.yaml. See `python build.py --help`."""

import sys

if sys.version_info < (3, 10):  # noqa: UP036 - a friendly message on an old interpreter
    sys.exit("build.py needs Python >= 3.10 (found {}.{})".format(*sys.version_info[:2]))

from builder.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
