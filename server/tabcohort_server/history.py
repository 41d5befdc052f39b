"""A room's curves since it started, bounded: what the operator view draws on load.

Sampled from the leader's state reports (about once a second, ``app._ticker``); a point is kept
only when the step moved. At most ``2 * max_points`` points are held: when full, every other
point is dropped, so the history always spans the whole run at a coarser resolution (memory
O(max_points) per room, whatever the run's length).
"""

from __future__ import annotations

import math
from typing import Any


class RoomHistory:
    """Points ``[t_s, step, loss, accuracy]`` (t_s: seconds since the room's first point;
    loss/accuracy ``None`` when not finite or unknown).

    Args:
        max_points: the resolution kept after thinning (>= 16).
    """

    def __init__(self, max_points: int = 1000) -> None:
        if max_points < 16:
            raise ValueError("max_points must be >= 16")
        self.max_points = int(max_points)
        self.points: list[list[Any]] = []
        self._t0: float | None = None

    def add(self, now_s: float, step: Any, loss: Any, accuracy: Any) -> bool:
        """Append a point if ``step`` is an int beyond the last one (a lower step after a higher
        one starts a new run: the history restarts). Returns True if a point was added."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            return False
        if self.points and step <= self.points[-1][1]:
            if step == self.points[-1][1]:
                return False
            self.points.clear()
            self._t0 = None
        if self._t0 is None:
            self._t0 = now_s
        self.points.append([round(now_s - self._t0, 3), step, _finite(loss), _finite(accuracy)])
        if len(self.points) >= 2 * self.max_points:
            last = self.points[-1]
            self.points = self.points[::2]
            if self.points[-1] is not last:
                self.points.append(last)
        return True

    def to_json(self) -> dict[str, Any]:
        return {"fields": ["t_s", "step", "loss", "accuracy"], "points": self.points}


def _finite(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)
