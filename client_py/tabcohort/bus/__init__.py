"""Buses: one implementation per transport behind the bus contract (PROTOCOL.md)."""

from .base import Bus, LinkBytes, sum_link_bytes
from .memory import Delivery, LinkKnobs, MemoryBus, MemoryNetwork

__all__ = ["Bus", "Delivery", "LinkBytes", "LinkKnobs", "MemoryBus", "MemoryNetwork", "sum_link_bytes"]
