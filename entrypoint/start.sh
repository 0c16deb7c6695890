#!/bin/sh
# Container entrypoint, run by tini as PID 1's child:
#   ENTRYPOINT ["/usr/bin/tini", "-g", "--", "/opt/pt-multi-gpu/entrypoint/start.sh"]
# Everything happens in supervisor.py (standard library only, no torch import on the
# hot path). The OS python3 starts fastest; the venv's python is the fallback.
# -E -s: ignore PYTHON* variables and user site-packages meant for the user's code;
# -B: write no .pyc, so the image's entrypoint dir stays as built (and may be read-only).
here=$(dirname "$0")
for py in /usr/bin/python3 /opt/venv/bin/python; do
    [ -x "$py" ] && exec "$py" -E -s -B "$here/supervisor.py" "$@"
done
echo "[ptmg] ERROR: no python3 found (looked for /usr/bin/python3 and /opt/venv/bin/python)" >&2
exit 127
