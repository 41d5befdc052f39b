"""The cohort protocol as a sans-I/O state machine (``docs/PROTOCOL.md``)."""

from .actions import Action, Compute, Post, Report
from .assign import assignment
from .job import job_hash
from .machine import RankMachine
from .policy import Policy, Timing, policy

__all__ = ["Action", "Compute", "Post", "Report", "RankMachine", "Timing", "Policy", "policy",
           "assignment", "job_hash"]
