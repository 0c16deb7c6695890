#!/usr/bin/env python3
"""pt-multi-gpu: build multi-GPU PyTorch images from images.yaml. See `python build.py --help`."""

import sys

if sys.version_info < (3, 10):
    sys.exit("build.py needs Python >= 3.10 (found %d.%d)" % sys.version_info[:2])

from builder.cli import main  # noqa: E402 - after the version check on purpose

if __name__ == "__main__":
    sys.exit(main())
