"""Buses: the bus contract (PROTOCOL.md, "Bus contract") over each transport; the layers are in
docs/INTERFACES.md, "Bus" (the room buses live in ``star``, ``mesh``, ``aio`` and ``page``)."""

from .base import Bus, LinkBytes, RoomBus, sum_link_bytes
from .memory import Delivery, LinkKnobs, MemoryBus, MemoryNetwork

__all__ = ["Bus", "Delivery", "LinkBytes", "LinkKnobs", "MemoryBus", "MemoryNetwork", "RoomBus", "sum_link_bytes"]
