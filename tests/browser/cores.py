"""Split the cores between "the lab" and "the world" while a tab's throughput is measured.

A tab is a volunteer's own machine: its compute is added, never taken from the native ranks. On a
CI machine of 2 shared cores, Chromium's Pyodide would otherwise compete with the native ranks
for the same cores, and "does the tab add?" would measure the scheduler, not the protocol. Used
by ``bench/bench_tab.py`` (the shares rows) and ``test_tab_shares.py``.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any


def browser_pids(root: int | None = None) -> list[int]:
    """The Chromium browser processes below ``root`` (default: this process), e.g. the one
    Playwright launched: a process whose name starts ``chrom`` under a parent that is not one."""
    out = []
    for pid in _descendants(os.getpid() if root is None else root):
        try:
            name = pathlib.Path(f"/proc/{pid}/comm").read_text().strip().lower()
            ppid = int(pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            parent = pathlib.Path(f"/proc/{ppid}/comm").read_text().strip().lower()
        except (OSError, IndexError, ValueError):
            continue
        if name.startswith("chrom") and not parent.startswith("chrom"):
            out.append(pid)
    return out


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for d in pathlib.Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def pin_tree(root: int, cpus: set[int]) -> int:
    """Set the CPU affinity of every thread of ``root`` and its descendants (processes forked
    later inherit it); returns how many threads were pinned."""
    n = 0
    for pid in _descendants(root):
        try:
            tids = [int(t.name) for t in pathlib.Path(f"/proc/{pid}/task").iterdir()]
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
                n += 1
            except OSError:
                pass
    return n


class CoreSplit:
    """The volunteer's compute is its own: while the shares rows run, this process (so the native
    ranks it starts) runs on every core but the last, and Chromium (browser, renderers, the
    tab's worker) and the server on the last one, as if the lab's native ranks were one machine
    and the server and the volunteer's tab the rest of the world. Without it, on a machine of 2
    cores the tab can only take CPU from the native ranks (and the relay from both), and "the
    tab adds" would measure the scheduler, not the protocol. The native ranks reach each other
    on direct TCP paths, so in the native-only cohort the server carries only controls."""

    def __init__(self, browser_pids: list[int], enabled: bool = True) -> None:
        ncpu = len(os.sched_getaffinity(0))
        self.enabled = enabled and ncpu >= 2
        self.browser_pids = list(browser_pids)
        self.all = os.sched_getaffinity(0)
        cpus = sorted(self.all)
        self.native, self.tab = set(cpus[:-1]), {cpus[-1]}

    def describe(self) -> str:
        if not self.enabled:
            return "native ranks, server and Chromium share every core"
        return (f"native ranks on cpu {','.join(map(str, sorted(self.native)))}, "
                f"the server and Chromium (the tab) on cpu {','.join(map(str, sorted(self.tab)))}")

    def __enter__(self) -> "CoreSplit":
        if self.enabled:
            os.sched_setaffinity(0, self.native)
            for pid in self.browser_pids:
                pin_tree(pid, self.tab)
        return self

    def repin(self) -> None:
        """After a page opens (a renderer may be forked from a process pinned earlier: no-op)."""
        if self.enabled:
            for pid in self.browser_pids:
                pin_tree(pid, self.tab)

    def serve(self, c: Any, *args: str) -> str:
        """``c.serve(*args)``, the server pinned with Chromium."""
        url = c.serve(*args)
        if self.enabled:
            pin_tree(c.server.p.pid, self.tab)
        return url

    def __exit__(self, *exc) -> None:
        if self.enabled:
            os.sched_setaffinity(0, self.all)
            for pid in self.browser_pids:
                pin_tree(pid, self.all)
