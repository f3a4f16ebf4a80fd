"""Rendering plans, hardware and runs for people (rich) and machines (JSON). No decisions here."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import IO, Any

from rich import box
from rich.console import Console
from rich.table import Table

from ftlaunch.plan.render import PIPE_WIDTH


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Out:
    """A rich console bound at print time to the current stdout/stderr (click's test runner swaps them).

    A terminal gets its real width; anything else PIPE_WIDTH columns and no colour.
    """

    def __init__(self, stderr: bool = False) -> None:
        self.stderr = stderr

    def console(self) -> Console:
        stream = sys.stderr if self.stderr else sys.stdout
        return Console(file=stream, width=None if _isatty(stream) else PIPE_WIDTH)

    def print(self, *objects: Any, **kw: Any) -> None:
        self.console().print(*objects, **kw)


def add_id_column(table: Table, header: str, ids: Iterable[str]) -> None:
    """A column that is never cut or wrapped: other columns wrap first (ids are what commands take)."""
    width = max([len(header), *(len(i) for i in ids)])
    table.add_column(header, no_wrap=True, min_width=width, overflow="ignore")


def runs_table(rows: list[dict[str, Any]]) -> Table:
    """`ftlaunch runs`: the id column is never cut; name and output_dir wrap instead."""
    # Light borders: at 80 columns every column keeps room; name and output_dir wrap first.
    t = Table(title=f"{len(rows)} run(s)", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    add_id_column(t, "id", [r["id"] for r in rows])
    t.add_column("name", overflow="fold", min_width=6)
    for col, width in (("status", 7), ("try", 3), ("progress", 5), ("loss", 6), ("started UTC", 11)):
        t.add_column(col, overflow="fold", min_width=width)
    t.add_column("output_dir", overflow="fold", min_width=10)
    for r in rows:
        prog = f"{r.get('step')}/{r.get('total_steps')}" if r.get("total_steps") else "-"
        loss = f"{r['loss']:.4f}" if isinstance(r.get("loss"), (int, float)) else "-"
        t.add_row(
            r["id"],
            str(r.get("name") or "-"),
            r["status"],
            str(r.get("attempt") or "-"),
            prog,
            loss,
            str(r.get("created") or "-")[5:16].replace("T", " ") or "-",  # MM-DD HH:MM
            str(r.get("output_dir") or "-"),
        )
    return t
