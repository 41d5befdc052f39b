"""tabcohort: elastic data-parallel training across browser tabs and native ranks.

The client package. Stdlib-only at module level so it loads into Pyodide; numpy is used
when importable (see :mod:`tabcohort._compat`).
"""

__version__ = "0.1.0"

#: Cohort protocol version carried in every ``hello`` (PROTOCOL.md, "Messages").
PROTOCOL_VERSION = 6
