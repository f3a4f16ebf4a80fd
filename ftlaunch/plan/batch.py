"""Batch arithmetic behind the planner's invariant: global batch = micro-batch x accumulation x world size.

``divisors_desc`` lists the micro-batches that keep a per-device batch exact (the planner, the memory
chooser and the OOM ladder all step down through them); ``split_batch`` picks one; ``devices_for`` is the
largest device count over which a global batch divides exactly (on every node alike). Pure.
"""

from __future__ import annotations

import math


def divisors_desc(n: int) -> list[int]:
    """The divisors of ``n``, largest first (pairs up to sqrt(n): a typed 1e20 is refused elsewhere,
    but no count a user types makes this loop long)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)}, reverse=True)


def split_batch(per_device: int, preferred_micro: int) -> tuple[int, int]:
    """The largest micro-batch <= preferred that divides per_device, and the accumulation."""
    micro = next(d for d in divisors_desc(per_device) if d <= max(1, preferred_micro))
    return micro, per_device // micro


def devices_for(global_batch: int, devices: int, nodes: int = 1) -> int:
    """The largest device count <= ``devices`` over which ``global_batch`` divides exactly, the same
    number on each of ``nodes`` nodes (``devices`` is all of theirs): the planner runs that many
    processes rather than change the global batch. On one node 1 always does; over several, 0 when
    the global batch does not divide over the nodes themselves."""
    per_node = max(1, min(devices // nodes, global_batch // nodes))
    return next((nodes * k for k in range(per_node, 0, -1) if global_batch % (nodes * k) == 0), 0)


def epoch_steps(rows: int, micro_batch: int, accumulation: int, world: int) -> tuple[int, int]:
    """(micro-batches per device, optimizer steps) of one epoch over ``rows``, as transformers'
    Trainer counts them: ceil(rows / (micro x world)) micro-batches (no drop_last), ceil(that /
    accumulation) steps, at least 1 (the last step of an epoch accumulates fewer)."""
    batches = math.ceil(rows / (max(1, micro_batch) * max(1, world))) if rows else 0
    return batches, max(1, math.ceil(batches / max(1, accumulation)))
