"""ftlaunch.plan.change."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

REMOVED = "<removed>"  # the ``new`` of a Change that deletes a key


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "old": self.old, "new": self.new, "reason": self.reason}
