"""Small host-side ledgers of the engine loop: where its wall time goes (`PhaseTimes`), which device row of the
penalty state each live sequence owns (`PenaltySlots`), and how evenly a MoE model's experts are loaded
(`expert_load_stats`)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from jaxinfer.engine.sequence import SeqKey


class PhaseTimes:
    """Wall seconds the engine loop spent per phase, summed over steps: a cheap always-on profile.

    schedule: the scheduler's plan; prepare: packing the bucketed host arrays; device: dispatch until the
    sampled tokens are on the host (the device's work plus the launch); apply: turning tokens into request
    state, text and outputs. The loop is synchronous, so the four add up to the time spent in `step`.
    """

    PHASES = ("schedule", "prepare", "device", "apply")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.PHASES, 0.0)

    def add(self, phase: str, since: float) -> float:
        """Charge the time since `since` to `phase`; returns now, the start of the next phase."""
        now = time.perf_counter()
        self.seconds[phase] += now - since
        return now


class PenaltySlots:
    """Stable device rows of the penalty state, one per live sequence; rows are reset on (re)admission."""

    def __init__(self, num_slots: int) -> None:
        self.spare = num_slots  # padding rows read and write this extra row
        self._free = list(range(num_slots - 1, -1, -1))
        self._of: dict[SeqKey, int] = {}

    def get(self, key: SeqKey) -> tuple[int, bool]:
        """(slot, newly assigned)."""
        if key in self._of:
            return self._of[key], False
        slot = self._free.pop()
        self._of[key] = slot
        return slot, True

    def release(self, key: SeqKey) -> None:
        slot = self._of.pop(key, None)
        if slot is not None:
            self._free.append(slot)


def expert_load_stats(counts: np.ndarray) -> dict[str, Any]:
    """Per-expert (token, expert) pair counts summed over MoE layers and steps, and their balance: max/mean
    is 1.0 for perfectly even routing (random routers come close; trained ones are skewed)."""
    mean = float(counts.mean())
    return {"expert_token_counts": [int(c) for c in counts],
            "expert_load_max_over_mean": float(counts.max()) / mean if mean > 0 else None}
