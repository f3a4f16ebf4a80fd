"""Cron expressions (pure: no files, no clock, no environment).

``parse_cron`` reads a standard 5-field expression or an ``@`` macro, with Vixie cron's rule for the
two day fields (no cron library is a dependency of ftlaunch); ``next_fire`` finds the next minute it
matches; ``on_calendar`` gives the systemd ``OnCalendar=`` values that fire at the same times.
``ScheduleError`` (bad input to ``ftlaunch schedule``, a usage error) is defined here, the lowest
module that raises it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta

from ftlaunch.errors import ExitCode, FtlaunchError


class ScheduleError(FtlaunchError):
    """Bad input to `schedule`: a cron expression, a name, a duplicate. A usage error (2)."""

    exit_code = ExitCode.USAGE


# ---------------------------------------------------------------- parsing and next fire time


@dataclass(frozen=True)
class _Field:
    name: str
    lo: int
    hi: int
    names: Mapping[str, int] = field(default_factory=dict)


MONTHS = {m: i + 1 for i, m in enumerate("jan feb mar apr may jun jul aug sep oct nov dec".split())}
WEEKDAYS = {d: i for i, d in enumerate("sun mon tue wed thu fri sat".split())}
FIELDS = (
    _Field("minute", 0, 59),
    _Field("hour", 0, 23),
    _Field("day of month", 1, 31),
    _Field("month", 1, 12, MONTHS),
    _Field("day of week", 0, 7, WEEKDAYS),  # 0 and 7 are both Sunday
)
MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}


@dataclass(frozen=True)
class Cron:
    """A parsed 5-field cron expression, with Vixie cron's day-of-month/day-of-week rule."""

    text: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday .. 6 = Saturday
    days_star: bool  # the field starts with '*': then both day fields must match, else either
    weekdays_star: bool

    def day_matches(self, d: date) -> bool:
        dom = d.day in self.days
        dow = d.isoweekday() % 7 in self.weekdays
        if self.days_star or self.weekdays_star:
            return dom and dow
        return dom or dow


def _value(token: str, f: _Field, problems: list[str], item: str) -> int | None:
    if token.isdigit():
        v = int(token)
    elif token.lower() in f.names:
        v = f.names[token.lower()]
    else:
        problems.append(f"{f.name}: {item!r} is not a number{' or a name' if f.names else ''}")
        return None
    if not f.lo <= v <= f.hi:
        problems.append(f"{f.name}: {v} is out of range {f.lo}-{f.hi}")
        return None
    return v


def _parse_field(text: str, f: _Field, problems: list[str]) -> frozenset[int]:
    values: set[int] = set()
    for item in text.split(","):
        if not item:
            problems.append(f"{f.name}: empty item in {text!r}")
            continue
        base, slash, step_text = item.partition("/")
        step = 1
        if slash:
            if not step_text.isdigit() or int(step_text) == 0:
                problems.append(f"{f.name}: step {step_text!r} in {item!r} must be a positive number")
                continue
            step = int(step_text)
        if base == "*":
            lo, hi = f.lo, f.hi
        elif "-" in base:
            a, _, b = base.partition("-")
            lo_v, hi_v = _value(a, f, problems, item), _value(b, f, problems, item)
            if lo_v is None or hi_v is None:
                continue
            if lo_v > hi_v:
                problems.append(f"{f.name}: range {item!r} runs backwards")
                continue
            lo, hi = lo_v, hi_v
        else:
            v = _value(base, f, problems, item)
            if v is None:
                continue
            lo, hi = v, (f.hi if slash else v)  # "5/15" means 5-max/15, as in cronie
        values.update(range(lo, hi + 1, step))
    if f.name == "day of week" and 7 in values:
        values = (values - {7}) | {0}
    return frozenset(values)


def parse_cron(text: str) -> Cron:
    """Parse a standard cron expression; raise ScheduleError listing every problem."""
    normal = " ".join(text.split())
    expanded = MACROS.get(normal.lower(), normal)
    if normal.lower() == "@reboot":
        raise ScheduleError("cron expression '@reboot' is not a time", hint='give a time, e.g. --cron "0 2 * * *"')
    if expanded.startswith("@"):
        raise ScheduleError(
            f"cron expression {text!r}: unknown macro", hint=f"macros: {', '.join(sorted(MACROS))}, or 5 fields"
        )
    parts = expanded.split()
    if len(parts) != 5:
        raise ScheduleError(
            f"cron expression {text!r} has {len(parts)} field(s), not 5",
            hint='minute hour day-of-month month day-of-week, e.g. "0 2 * * *" (every night at 02:00)',
        )
    problems: list[str] = []
    sets = [_parse_field(p, f, problems) for p, f in zip(parts, FIELDS, strict=True)]
    if problems:
        raise ScheduleError(
            f"cron expression {text!r}: " + "; ".join(problems),
            hint='minute hour day-of-month month day-of-week, e.g. "0 2 * * *" or "30 3 * * mon-fri"',
        )
    cron = Cron(normal, *sets, days_star=parts[2].startswith("*"), weekdays_star=parts[4].startswith("*"))
    if next_fire(cron, datetime(2000, 1, 1)) is None:
        raise ScheduleError(f"cron expression {text!r} never fires (no such date)", hint="check day and month")
    return cron


def next_fire(cron: Cron, after: datetime) -> datetime | None:
    """The first minute strictly after ``after`` that the expression matches (same tz as ``after``)."""
    t = after.replace(second=0, microsecond=0) + timedelta(minutes=1)
    limit = t + timedelta(days=366 * 8)  # covers 29 February on a given weekday
    while t < limit:
        if t.month not in cron.months:
            t = (t.replace(day=1, hour=0, minute=0) + timedelta(days=32)).replace(day=1)
        elif not cron.day_matches(t.date()):
            t = t.replace(hour=0, minute=0) + timedelta(days=1)
        elif t.hour not in cron.hours:
            t = t.replace(minute=0) + timedelta(hours=1)
        elif t.minute not in cron.minutes:
            t += timedelta(minutes=1)
        else:
            return t
    return None


# ---------------------------------------------------------------- systemd equivalent


def on_calendar(cron: Cron) -> list[str]:
    """systemd OnCalendar= values for a cron expression (two when either day field may match)."""

    def part(values: frozenset[int], lo: int, hi: int) -> str:
        return "*" if values >= set(range(lo, hi + 1)) else ",".join(f"{v:02d}" for v in sorted(values))

    hm = f"{part(cron.hours, 0, 23)}:{part(cron.minutes, 0, 59)}:00"
    month = part(cron.months, 1, 12)
    days = part(cron.days, 1, 31)
    names = ["Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"]
    weekdays = "" if cron.weekdays >= set(range(7)) else ",".join(names[d] for d in sorted(cron.weekdays)) + " "
    if cron.days_star or cron.weekdays_star or not weekdays or days == "*":
        return [f"{weekdays}*-{month}-{days} {hm}"]
    return [f"*-{month}-{days} {hm}", f"{weekdays}*-{month}-* {hm}"]  # cron: either day field matches
