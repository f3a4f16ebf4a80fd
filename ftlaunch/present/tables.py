"""The one rendering rule for every table ftlaunch prints (issue 24): each column says what its cells
are, and a table that cannot show every cell whole at the console's width changes layout, never cuts.

Kinds of cell:
- ``word``: keys, ids, numbers, progress, ranges. Never wrapped, never cut: a key is what people type.
- ``path``: wraps only after a ``/`` (or at a space between two paths), so the lines re-join to the path.
- ``prose``: reasons and notes. Wraps at spaces; only a token wider than the whole column is folded.

The layout is chosen when the table is drawn (``__rich_console__``), so a terminal of any width,
piped output and plan.txt (PIPE_WIDTH) get the same rule: a grid when every word column at its full
width and every other column at its narrowest fit, else stacked (one block per row, ``header: value``
lines; a headerless table's label on its own line, its values indented below).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.padding import Padding
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

Kind = Literal["word", "path", "prose"]
GAP = 2  # columns between two grid columns: one of padding, one of the (blank) divider
FLEX_MIN = 16  # the narrowest a path or prose column gets in a grid, unless its text is narrower
BAR_WIDTH = 40  # a progress bar's width when there is room
BAR_MIN = 10
INDENT = 2  # a stacked value placed under its label


@dataclass(frozen=True)
class Col:
    header: str
    kind: Kind = "word"
    justify: Literal["left", "right"] = "left"
    style: str = ""


@dataclass(frozen=True)
class Cell:
    """A cell whose kind or style is not its column's (a path in a table of prose values, a dim group title)."""

    text: str
    kind: Kind | None = None
    style: str = ""


@dataclass(frozen=True)
class Bar:
    """A progress bar cell: as wide as there is room, up to BAR_WIDTH."""

    completed: float
    total: float


CellValue = str | Cell | Bar

_TOKENS = {
    "path": re.compile(r"[^/\s]*/+|[^/\s]+|\s+"),  # a piece ends after its slash(es)
    "prose": re.compile(r"\S+|\s+"),
}


def tokens(text: str, kind: Kind) -> list[str]:
    """The pieces a line may break between (white space kept as its own pieces)."""
    return [text] if kind == "word" else _TOKENS[kind].findall(text)


def wrap(text: str, kind: Kind, width: int) -> list[str]:
    """``text`` as lines of at most ``width`` columns, broken only where ``kind`` allows; a newline
    always breaks. A piece wider than ``width`` is folded, after its last slash that fits if it has
    one (a path inside prose): the last resort, when the console itself is narrower than the piece
    (a table's layout never asks for it otherwise)."""
    width = max(1, width)
    lines: list[str] = []
    for para in text.split("\n"):
        line, first = "", True  # a paragraph keeps its own indent; a wrapped line starts at a piece
        for tok in tokens(para, kind):
            if tok.isspace():
                line += tok if line or first else ""
                continue
            first = False
            if line and len(line) + len(tok) > width:
                lines.append(line.rstrip())
                line = ""
            line += tok
            while len(line) > width:
                cut = line.rfind("/", 0, width) + 1 or width
                lines.append(line[:cut])
                line = line[cut:]
        lines.append(line.rstrip())
    return lines


def narrowest(text: str, kind: Kind) -> int:
    """The narrowest column ``text`` fits without breaking a piece."""
    return max((len(t) for t in tokens(text, kind) if not t.isspace()), default=0) if kind != "word" else widest(text)


def widest(text: str) -> int:
    return max((len(line) for line in text.split("\n")), default=0)


class Grid:
    """A table drawn by the rule above. Cells are plain text (never read as markup)."""

    def __init__(
        self,
        *cols: Col,
        title: str | None = None,
        caption: str | None = None,
        show_header: bool = True,
    ) -> None:
        self.cols = cols
        self.title = title
        self.caption = caption
        self.show_header = show_header
        self.rows: list[tuple[CellValue, ...]] = []
        self.section_ends: set[int] = set()

    def add_row(self, *cells: CellValue) -> None:
        if len(cells) != len(self.cols):
            raise ValueError(f"{len(cells)} cells for {len(self.cols)} columns")
        self.rows.append(cells)

    def add_section(self) -> None:
        """End a group of rows: a blank line in a grid, a blank line between stacked blocks anyway."""
        if self.rows:
            self.section_ends.add(len(self.rows) - 1)

    # -- layout -----------------------------------------------------------------------------------

    def _kind(self, i: int, cell: CellValue) -> Kind:
        return (cell.kind if isinstance(cell, Cell) else None) or self.cols[i].kind

    def _text(self, cell: CellValue) -> str:
        return cell.text if isinstance(cell, Cell) else "" if isinstance(cell, Bar) else cell

    def _bounds(self, i: int) -> tuple[int, int]:
        """(narrowest, natural) width of column ``i``; a word column's narrowest is its natural."""
        col = self.cols[i]
        lo = narrowest(col.header, "prose") if self.show_header else 0
        hi = len(col.header) if self.show_header else 0
        for row in self.rows:
            cell = row[i]
            if isinstance(cell, Bar):
                lo, hi = max(lo, BAR_MIN), max(hi, BAR_WIDTH)
                continue
            text, kind = self._text(cell), self._kind(i, cell)
            lo, hi = max(lo, narrowest(text, kind)), max(hi, widest(text))
        if col.kind != "word":
            lo = max(lo, min(hi, FLEX_MIN))
        return lo, hi

    def widths(self, width: int) -> list[int] | None:
        """Each column's width in a grid ``width`` columns wide, or None: it must be stacked."""
        avail = width - GAP * (len(self.cols) - 1)
        bounds = [self._bounds(i) for i in range(len(self.cols))]
        if sum(lo for lo, _ in bounds) > avail:
            return None
        if sum(hi for _, hi in bounds) <= avail:
            return [hi for _, hi in bounds]
        # As rich collapses columns: narrow the widest column that may still narrow, one column at a
        # time, so the flexible columns end up balanced (a long path and long reasons share the room).
        out = [hi for _, hi in bounds]
        for _ in range(sum(out) - avail):
            i = max((j for j in range(len(out)) if out[j] > bounds[j][0]), key=lambda j: out[j])
            out[i] -= 1
        # A path wraps short of its column (it breaks only at a slash): what it leaves over goes to
        # the column that wraps into the most lines, until nothing is left or nothing changes.
        for _ in range(4):
            out = [self._used(i, w) for i, w in enumerate(out)]
            spare = avail - sum(out)
            growing = [j for j in range(len(out)) if out[j] < bounds[j][1]]
            if not spare or not growing:
                break
            j = max(growing, key=lambda k: self._lines(k, out[k]))
            out[j] = min(bounds[j][1], out[j] + spare)
        return out

    def _lines(self, i: int, width: int) -> int:
        return sum(len(wrap(self._text(row[i]), self._kind(i, row[i]), width)) for row in self.rows)

    def _used(self, i: int, width: int) -> int:
        """The widest line column ``i`` takes when ``width`` columns wide (never under its header's)."""
        texts = [(self._text(row[i]), self._kind(i, row[i])) for row in self.rows if not isinstance(row[i], Bar)]
        bars = any(isinstance(row[i], Bar) for row in self.rows)
        head = [widest("\n".join(wrap(self.cols[i].header, "prose", width)))] if self.show_header else []
        lines = [widest("\n".join(wrap(t, k, width))) for t, k in texts]
        return max([*head, *lines, min(width, BAR_WIDTH) if bars else 0])

    # -- drawing ----------------------------------------------------------------------------------

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        widths = self.widths(width)
        if widths is not None:
            yield self._grid(widths)
        else:
            yield from self._stacked(width)

    def _grid(self, widths: list[int]) -> Table:
        t = Table(
            title=self.title,
            caption=self.caption,
            show_header=self.show_header,
            box=box.SIMPLE_HEAD,
            show_edge=False,
            pad_edge=False,
            collapse_padding=True,
        )
        for col, w in zip(self.cols, widths, strict=True):
            header = Text("\n".join(wrap(col.header, "prose", w)))
            # every line is at most w already: "fold" only guards ("ignore" would drop the justify)
            t.add_column(header, width=w, no_wrap=True, overflow="fold", justify=col.justify, style=col.style)
        for n, row in enumerate(self.rows):
            cells = [self._draw(i, cell, w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))]
            t.add_row(*cells, end_section=n in self.section_ends and n != len(self.rows) - 1)
        return t

    def _draw(self, i: int, cell: CellValue, width: int) -> Text | ProgressBar:
        if isinstance(cell, Bar):
            return ProgressBar(total=cell.total, completed=cell.completed, width=min(BAR_WIDTH, width))
        style = cell.style if isinstance(cell, Cell) else ""
        return Text("\n".join(wrap(self._text(cell), self._kind(i, cell), width)), style=style)

    def _stacked(self, width: int) -> Iterable[Text | ProgressBar | Padding]:
        if self.title:
            yield Text(self.title, style="table.title")
        labels = [f"{c.header}:" for c in self.cols]
        label_w = max(len(x) for x in labels)
        beside = width - label_w - 1  # room for a value beside its label
        for n, row in enumerate(self.rows):
            if self.show_header:
                if n:
                    yield Text("")
                if not any(self._text(c) or isinstance(c, Bar) for c in row[1:]):  # a group's title row
                    yield self._draw(0, row[0], width)
                    continue
                for i, cell in enumerate(row):
                    yield from self._stacked_value(i, cell, labels[i].ljust(label_w), beside, width)
            else:  # the first cell labels the row; the others go indented below it
                if n in self.section_ends or n and (n - 1) in self.section_ends:
                    yield Text("")
                first, *rest = row
                yield self._draw(0, first, width)
                for i, cell in enumerate(rest, start=1):
                    if self._text(cell) or isinstance(cell, Bar):
                        yield from self._stacked_value(i, cell, "", width, width)
        if self.caption:
            yield Text(self.caption, style="table.caption")

    def _stacked_value(self, i: int, cell: CellValue, label: str, beside: int, width: int) -> Iterable[Text | Padding]:
        """One value under its label: beside it when it fits there, else indented on the lines below."""
        if isinstance(cell, Bar):
            if label:
                yield Text(label.rstrip())
            bar = ProgressBar(total=cell.total, completed=cell.completed, width=min(BAR_WIDTH, width - INDENT))
            yield Padding(bar, (0, 0, 0, INDENT))
            return
        text, kind = self._text(cell), self._kind(i, cell)
        if not text:
            return
        style = cell.style if isinstance(cell, Cell) else ""
        pad = len(label) + 1 if label else INDENT
        room = beside if label else width - INDENT
        if narrowest(text, kind) > room or room < FLEX_MIN and widest(text) > room:
            if label:
                yield Text(label.rstrip())
            pad, room = INDENT, width - INDENT
        lines = wrap(text, kind, room)
        for j, line in enumerate(lines):
            head = label + " " if j == 0 and pad != INDENT and label else " " * pad
            yield Text(head).append(line, style=style or self.cols[i].style)


def kv_table(
    title: str | None,
    rows: Iterable[tuple[str, CellValue]],
    value_kind: Kind = "prose",
    justify: Literal["left", "right"] = "left",
) -> Grid:
    """A headerless two-column table of (label, value) rows; labels are prose, values ``value_kind``
    unless a Cell says otherwise."""
    g = Grid(Col("what", "prose"), Col("value", value_kind, justify=justify), title=title, show_header=False)
    for label, value in rows:
        g.add_row(label, value)
    return g


class Para:
    """A line of text outside a table, wrapped by the same kinds at the console's width: a note,
    an assumption, a warning with a path in it. ``hang`` indents the lines after the first."""

    def __init__(self, text: str | Text, kind: Kind = "prose", hang: int = 0) -> None:
        self.text = Text(text) if isinstance(text, str) else text
        self.kind = kind
        self.hang = hang

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        plain, pos = self.text.plain, 0
        for n, line in enumerate(wrap(plain, self.kind, options.max_width - self.hang)):
            pos = plain.find(line, pos) if line else pos
            piece = self.text[pos : pos + len(line)]
            pos += len(line)
            yield Text(" " * self.hang).append_text(piece) if n and self.hang else piece
