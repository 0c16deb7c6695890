"""In-image smoke tests for pt-multi-gpu images (copied to /opt/pt-multi-gpu/smoke_tests/).

Run them with ``selftest`` (``docker run IMAGE selftest``); see README.md.
"""
