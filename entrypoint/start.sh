#!/bin/sh
# Container entrypoint, run by tini as PID 1's child:
#   ENTRYPOINT ["/usr/bin/tini", "-g", "--", "/opt/pt-multi-gpu/entrypoint/start.sh"]
# It runs as pt (the image's USER), or as root with `docker run --user 0` (only needed
# for PT_UID/PT_GID; supervisor.py then drops to pt for good before anything else).
# So root may run this file: no external command here (no PATH lookup), the OS python by
# absolute path, isolated (-I: no PYTHON* variables, no user site, no script or working
# directory on sys.path) and writing no .pyc (-B: the image's entrypoint dir stays as built).
here=${0%/*}
for py in /usr/bin/python3 /usr/local/bin/python3; do
    [ -x "$py" ] && exec "$py" -I -B "$here/supervisor.py" "$@"
done
echo "[ptmg] ERROR: no python3 found (looked for /usr/bin/python3 and /usr/local/bin/python3)" >&2
exit 127
