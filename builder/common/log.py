"""Logging to stderr (rich on a terminal, plain lines otherwise) and plain-text tables."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.live import Live
    from rich.table import Table


def _handler() -> logging.Handler:
    if sys.stderr.isatty() and not os.environ.get("NO_COLOR"):
        try:
            from rich.logging import RichHandler

            return RichHandler(show_path=False, show_time=False, markup=False)
        except ImportError:
            pass
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("%(levelname)s %(message)s" if os.environ.get("PTMG_DEBUG") else "%(message)s"))
    return h


log = logging.getLogger("pt-multi-gpu")
log.addHandler(_handler())
log.setLevel(logging.DEBUG if os.environ.get("PTMG_DEBUG") else logging.INFO)
log.propagate = False


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain, aligned text table (stable output for tests and logs)."""
    columns = zip(header, *rows, strict=False)
    widths = [max(len(str(x)) for x in col) for col in columns] if rows else [len(h) for h in header]
    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=False)).rstrip()
    out = [line(header), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


class BuildProgress:
    """Per-cell build progress on stderr: a live table on a terminal, plain step lines otherwise.

    Only step headers are shown (`#7 [3/8] RUN ...`); every line goes to the cell's log file.
    """

    def __init__(self, cells: Sequence[str]) -> None:
        self.state = {c: "waiting" for c in cells}
        self.live: Live | None = None
        if sys.stderr.isatty() and not os.environ.get("NO_COLOR"):
            try:
                from rich.console import Console
                from rich.live import Live

                self.live = Live(self._render(), console=Console(stderr=True), refresh_per_second=4, transient=True)
            except ImportError:
                self.live = None

    def _render(self) -> Table:
        from rich.table import Table

        t = Table(show_header=False, box=None)
        for cell, state in self.state.items():
            t.add_row(cell, state[:100])
        return t

    def __enter__(self) -> BuildProgress:
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(None, None, None)

    def line(self, cell: str, text: str) -> None:
        if not _is_step(text):
            return
        text = " ".join(text.split())  # BuildKit prints multi-line RUNs on one line with runs of spaces
        if len(text) > 110:
            text = text[:107] + "..."
        self.state[cell] = text
        if self.live is not None:
            self.live.update(self._render())
        else:
            print(f"[{cell}] {text}", file=sys.stderr, flush=True)


def _is_step(text: str) -> bool:
    # BuildKit plain progress: "#7 [3/8] RUN ...", classic: "Step 3/8 : RUN ..."
    return (text.startswith("#") and "] " in text and "/" in text.split("]", maxsplit=1)[0]) or text.startswith("Step ")


def human_size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return f"{n} B"
