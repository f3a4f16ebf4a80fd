"""The recovery policy: how hard a run tries before it gives up. One frozen record, `RecoveryPolicy`,
carried whole from the command line (its options are generated from `OPTIONS`) through `RunOptions`
and the supervisor's settings into the run's state. Pure: values in, values out.

`Retries` holds the budgets: a policy's maxima, and (in `state.Budget`) what a run has used of them.
A failure class's row in `recovery.POLICIES` names one of its fields. A new budget is one field in
`Retries` and one row in `OPTIONS`; the click option, the state.json keys (``{budget}_max`` and
``{budget}_used``) and the key a schedule record stores follow from them.

The records written before this one still read: state.json keeps its keys (see `state.policy_fields`),
and a schedule record keeps the run options flat, as `train` takes them (`RecoveryPolicy.to_options`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import Any, Protocol

from ftlaunch.run.health import OnDiverge

# Bounds on the numbers a user types (issue 31).
MAX_RETRIES = 1000  # a retry budget beyond this is no budget
MAX_STALL_TIMEOUT_S = 7 * 24 * 3600.0  # a week without progress is a stall by any measure


@dataclass(frozen=True)
class Retries:
    """Attempts per budget: a policy's maxima, or what a run has used of them since its last progress."""

    oom: int = 4  # distinct configurations that ran out of memory (the OOM ladder)
    crash: int = 2  # crashes that are not an OOM or a config error (and host OOMs)
    stall: int = 2  # restarts after a stall

    @staticmethod
    def names() -> tuple[str, ...]:
        """The budgets, in declaration order."""
        return tuple(f.name for f in fields(Retries))

    @staticmethod
    def zero() -> Retries:
        return Retries(**dict.fromkeys(Retries.names(), 0))

    def of(self, budget: str) -> int:
        return int(getattr(self, budget))


class Kind(StrEnum):
    """How an option row is typed on the command line (cli/options.py turns it into a click option)."""

    COUNT = "count"  # a whole number from `low` to `high`, its default shown
    SECONDS = "seconds"  # a finite number of seconds from `low` to `high`; unset: None (derived)
    OFF = "off"  # a flag that turns the field (True by default) off
    CHOICE = "choice"  # one of an enum's words, its default shown; the policy holds the enum


@dataclass(frozen=True)
class Option:
    """One row of the option table: the click option that sets one field of the policy.

    ``field``: `RecoveryPolicy`'s field, or ``retries.NAME`` for a budget. ``dest``: the keyword click
    passes, and the key a schedule record stores (as `train` takes it)."""

    field: str
    flag: str
    dest: str
    kind: Kind
    help: str
    low: float = 0
    high: float = MAX_RETRIES
    choices: type[StrEnum] | None = None

    @property
    def budget(self) -> str | None:
        """The budget this row sets the maximum of (a field of `Retries`), or None."""
        return self.field.removeprefix("retries.") if self.field.startswith("retries.") else None

    def get(self, policy: RecoveryPolicy) -> Any:
        """The field's value, as this option spells it (an OFF flag set when the field is off)."""
        value = policy.retries.of(self.budget) if self.budget else getattr(policy, self.field)
        return (not value) if self.kind is Kind.OFF else value

    def parse(self, value: Any) -> Any:
        """A stored or typed value as the policy holds it (a schedule record holds an enum's word)."""
        if self.kind is Kind.OFF:
            return not value
        if self.kind is Kind.CHOICE and self.choices is not None:
            return self.choices(value)
        if self.kind is Kind.COUNT:
            return int(value)
        return float(value)

    @property
    def default(self) -> Any:
        """What the option passes when not given: the policy's default (None for a flag and for a
        number derived when unset)."""
        value = self.get(RecoveryPolicy())
        return None if self.kind is Kind.OFF else value


# The option table: one row per policy field, in the order `train --help` lists them.
OPTIONS: tuple[Option, ...] = (
    Option("retries.oom", "--max-retries", "max_retries", Kind.COUNT,
           "OOM recovery steps without progress before giving up."),
    Option("retries.crash", "--max-crash-retries", "max_crash_retries", Kind.COUNT,
           "Retries after a crash that is not an OOM or a config error."),
    Option("recover", "--no-recover", "no_recover", Kind.OFF, "Never retry: a failure ends the run."),
    Option("on_diverge", "--on-diverge", "on_diverge", Kind.CHOICE,
           "When the loss goes non-finite, spikes or goes dead: roll back to the last clean checkpoint with "
           "a lower learning rate (at most 2 times; none left: the run ends diverged), the same but restart from "
           "the base model when none is left, stop, or only record it (docs/health.md).", choices=OnDiverge),
    Option("stall_timeout", "--stall-timeout", "stall_timeout", Kind.SECONDS,
           "Seconds without progress (a new step or a growing checkpoint) after which the trainer is "
           "stalled: stacks dumped, restarted from the last checkpoint. Default: max(600, 5x the longest "
           "step interval seen), longer before the first step and while saving or evaluating.",
           low=1, high=MAX_STALL_TIMEOUT_S),
    Option("retries.stall", "--max-stall-restarts", "max_stall_restarts", Kind.COUNT,
           "Restarts after a stall before the run ends `stalled`."),
)  # fmt: skip


@dataclass(frozen=True)
class RecoveryPolicy:
    """How a run recovers: the budgets' maxima, whether it retries at all, what numeric health does
    when the loss diverges (ftlaunch.run.health) and the stall watchdog's timeout (ftlaunch.run.stall;
    None: derived from the run itself)."""

    retries: Retries = Retries()
    recover: bool = True
    on_diverge: OnDiverge = OnDiverge.ROLLBACK
    stall_timeout: float | None = None

    @staticmethod
    def dests() -> frozenset[str]:
        """The option keywords (and a schedule record's keys) that set a policy."""
        return frozenset(o.dest for o in OPTIONS)

    @classmethod
    def from_options(cls, values: Mapping[str, Any] | None = None, /, **more: Any) -> RecoveryPolicy:
        """A policy from option keywords (click's, or a schedule record's flat keys); a key that is absent
        or None keeps the default. Other keys are ignored."""
        return RecoveryPolicy().with_options({**(values or {}), **more})

    def with_options(self, values: Mapping[str, Any]) -> RecoveryPolicy:
        """This policy with the options given in ``values`` (absent or None: kept) put over it."""
        policy, budgets = self, {}
        for o in OPTIONS:
            if values.get(o.dest) is None:
                continue
            if o.budget:
                budgets[o.budget] = o.parse(values[o.dest])
            else:
                policy = replace(policy, **{o.field: o.parse(values[o.dest])})
        return replace(policy, retries=replace(policy.retries, **budgets))

    def to_options(self) -> dict[str, Any]:
        """The policy as option keywords, the words of its enums (what a schedule record stores)."""
        out = {o.dest: o.get(self) for o in OPTIONS}
        return {k: v.value if isinstance(v, StrEnum) else v for k, v in out.items()}

    def state_fields(self) -> dict[str, Any]:
        """The RunState fields that record this policy, under the keys state.json has always had:
        ``budget`` (the maxima, ``{budget}_max``; nothing used yet), ``recover``, ``on_diverge`` and
        ``stall_timeout``. Kept so because an ftlaunch of before the record keeps a key it does not know
        aside and would run a newer run (a Slurm job's, a cron's) with the default policy."""
        return {
            "budget": Budget(self.retries),
            "recover": self.recover,
            "on_diverge": self.on_diverge,
            "stall_timeout": self.stall_timeout,
        }

    @classmethod
    def of_state(cls, state: RecordsPolicy) -> RecoveryPolicy:
        """The policy a run's state records (a state written before the record reads the same)."""
        return cls(state.budget.limits, state.recover, state.on_diverge or OnDiverge.ROLLBACK, state.stall_timeout)


class RecordsPolicy(Protocol):
    """What records a policy: a run's RunState (ftlaunch.run.state, which imports this module; named
    by its fields here so the two need not import each other)."""

    budget: Budget
    recover: bool
    on_diverge: OnDiverge | None
    stall_timeout: float | None


@dataclass(frozen=True, init=False)
class Budget:
    """Retries left, as a run's state holds them: its maxima (its RecoveryPolicy's ``retries``) and what
    it has used of them since its last progress (`recovery.decide` spends and refills them).
    ``tried``: the distinct configurations that ran out of memory since the last progress (a new
    checkpoint empties it); the OOM budget counts them, not the halvings.

    state.json spells each budget flat, ``{budget}_max`` and ``{budget}_used`` (``oom_max``,
    ``crash_used``, ...); the constructor takes those names as keywords too (``Budget(crash_max=1)``),
    and they read as attributes (``budget.crash_max``)."""

    limits: Retries
    used: Retries
    tried: tuple[str, ...]

    def __init__(
        self, limits: Retries | None = None, used: Retries | None = None, tried: Iterable[str] = (), **flat: int
    ) -> None:
        if unknown := sorted(set(flat) - set(_FLAT)):
            raise TypeError(f"Budget() got unexpected keyword arguments {unknown}")
        pick = {side: {b: int(flat[f"{b}_{side}"]) for b in Retries.names() if f"{b}_{side}" in flat}
                for side in ("max", "used")}  # fmt: skip
        object.__setattr__(self, "limits", replace(limits or Retries(), **pick["max"]))
        object.__setattr__(self, "used", replace(used or Retries.zero(), **pick["used"]))
        object.__setattr__(self, "tried", tuple(str(t) for t in tried))

    def __getattr__(self, name: str) -> int:
        if name in _FLAT:
            budget, side = _FLAT[name]
            return (self.limits if side == "max" else self.used).of(budget)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Budget:
        return cls(tried=d.get("tried") or (), **{k: int(d[k]) for k in _FLAT if d.get(k) is not None})

    def to_json(self) -> dict[str, Any]:
        return {**{k: getattr(self, k) for k in _FLAT}, "tried": list(self.tried)}

    def most(self, budget: str) -> int:
        return self.limits.of(budget)

    def spent(self, budget: str) -> int:
        return self.used.of(budget)

    def spending(self, budget: str, n: int) -> Budget:
        """This budget with ``n`` used of ``budget``."""
        return replace(self, used=replace(self.used, **{budget: n}))

    def refilled(self) -> Budget:
        """A fresh budget of the same size (a resume by hand: the user changed something)."""
        return Budget(self.limits)


# state.json's flat names of the budgets: "oom_max" -> ("oom", "max"), "oom_used" -> ("oom", "used"), ...
_FLAT = {f"{b}_{side}": (b, side) for b in Retries.names() for side in ("max", "used")}
