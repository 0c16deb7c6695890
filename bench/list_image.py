"""List an image's files natively, to show that two builds made the same image.

`docker create` + `docker export` streams the image's filesystem to this process (no container runs,
so an emulated image is read at native speed); each entry gives one line: path, mode, owner, size,
type, link target and the md5 of a file's bytes, sorted by path. `diff` two listings.

    .venv/bin/python bench/list_image.py IMAGE OUT
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
from pathlib import Path

import ptmg_contract as contract


def listing(image: str) -> list[str]:
    made = subprocess.run(["docker", "create", "--label", "=".join(contract.PROJECT_LABEL), image, "true"],
                          check=True, capture_output=True, text=True, timeout=120)
    cid = made.stdout.strip()
    rows: list[str] = []
    try:
        with subprocess.Popen(["docker", "export", cid], stdout=subprocess.PIPE) as export:
            assert export.stdout is not None
            with tarfile.open(fileobj=export.stdout, mode="r|") as tar:
                for entry in tar:
                    digest = ""
                    data = tar.extractfile(entry) if entry.isfile() else None
                    if data is not None:
                        h = hashlib.md5()
                        while chunk := data.read(1 << 20):
                            h.update(chunk)
                        digest = h.hexdigest()
                    rows.append("\t".join((entry.name, f"{entry.mode:o}", f"{entry.uid}:{entry.gid}", str(entry.size),
                                           entry.type.decode(), entry.linkname, digest)))
        if export.returncode != 0:
            raise SystemExit(f"docker export {image} failed (exit {export.returncode})")
    finally:
        subprocess.run(["docker", "rm", "-f", cid], capture_output=True, timeout=120, check=False)
    return sorted(rows)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    rows = listing(argv[0])
    Path(argv[1]).write_text("\n".join(rows) + "\n")
    print(f"{argv[0]}: {len(rows)} entries -> {argv[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
