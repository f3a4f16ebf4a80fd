"""The one ``Change(key, old, new, reason)`` type: every adaptation ftlaunch makes to a config, by
the planner, the memory chooser, the hub (pre-downloaded weights and datasets) or the OOM ladder,
is one of these, shown as a row of the plan table and kept in plan.json.
"""

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
