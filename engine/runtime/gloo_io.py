"""Scheduling priority of the gloo transport thread of the pipeline process groups pipecast creates (Linux, CPU).

Each gloo process group has one I/O thread (``gloo_tcp_loop``) that moves the bytes of its sends and receives.
On a machine whose cores are all busy computing (2 pipeline ranks on 2 cores), that thread shares a core with its
rank's compute thread, and it costs the compute thread far more than the bytes it moves: woken by the peer's data
while the compute thread is posting a send on the same pair, it can take the core for milliseconds, which stalls
the pipeline (``benchmarks/investigations/gloo_post_stalls.py``).  At nice 19 the I/O thread still runs whenever
the compute thread waits, and gets its (small) fair share of the core otherwise, but it no longer holds the
compute thread off the core for long.  The cost: bytes that need the I/O thread while its rank computes (a
receive, or a send posted before the peer's receive) may move later; while the rank waits, nothing changes.
Measured effect: ``benchmarks/README.md`` (rows "gloo I/O thread not reniced").

Only the pipeline groups that :func:`engine.runtime.process_groups.build_process_groups` creates are affected: their I/O
threads are told apart from every other group's by when they appear, so a gloo group that another Python thread
creates at the same moment would be reniced too.  Raising a thread's nice value needs no privilege.
``PIPECAST_GLOO_IO_NICE=off`` (or ``build_process_groups(..., gloo_io_nice=None)``) leaves the threads alone; ``PIPECAST_GLOO_IO_NICE=<n>`` picks another value.  Where threads cannot be listed or reniced
(no ``/proc``, another OS, a sandbox refusing ``setpriority``) nothing changes.
"""
from __future__ import annotations

import contextlib
import os
import time
import warnings
from pathlib import Path
from typing import Iterator, Optional

__all__ = ["IO_THREAD_NAME", "DEFAULT_NICE", "NAME_WAIT_S", "parse_nice", "check_environment", "resolve_nice",
           "default_nice", "io_threads", "new_io_threads", "lowered_io_priority"]

IO_THREAD_NAME = "gloo_tcp_loop"
"""The name gloo gives the I/O thread of each of its process groups."""
DEFAULT_NICE = 19
"""Nice value given to the pipeline groups' gloo I/O threads unless ``PIPECAST_GLOO_IO_NICE`` says otherwise."""
_ENV = "PIPECAST_GLOO_IO_NICE"
NAME_WAIT_S = 5.0
"""Longest wait (seconds) for gloo's I/O threads to name themselves: a thread exists as soon as its group is
created, but takes the name :data:`IO_THREAD_NAME` only once it runs, which on a busy machine can be later."""


def parse_nice(raw: Optional[str]) -> Optional[int]:
    """The nice value a ``PIPECAST_GLOO_IO_NICE`` string asks for: None for ``off`` / ``none`` / empty,
    :data:`DEFAULT_NICE` when unset (``raw`` None), else an integer 0..19.

    Raises ``ValueError`` naming the variable, the value and the fix for anything else.
    """
    if raw is None:
        return DEFAULT_NICE
    value = raw.strip().lower()
    if value in ("", "off", "none"):
        return None
    try:
        nice = int(value)
    except ValueError:
        nice = -1
    if not 0 <= nice <= 19:
        raise ValueError(f"{_ENV}={raw!r} is not a nice value; set an integer 0..19 (e.g. 19), or 'off' to leave "
                         "gloo's I/O threads at the process's priority")
    return nice


def check_environment() -> None:
    """Raise ``ValueError`` if ``PIPECAST_GLOO_IO_NICE`` is set to something :func:`parse_nice` refuses (for
    launchers, before any rank starts)."""
    parse_nice(os.environ.get(_ENV))


def resolve_nice(option) -> Optional[int]:
    """The nice value for ``build_process_groups(gloo_io_nice=option)``: ``"default"`` -> :func:`default_nice`,
    None -> None, an integer 0..19 -> itself.  Raises ``ValueError`` naming the argument for anything else."""
    if isinstance(option, str) and option == "default":
        return default_nice()
    if option is None or (isinstance(option, int) and not isinstance(option, bool) and 0 <= option <= 19):
        return option
    raise ValueError(f"gloo_io_nice={option!r} is not a nice value; pass an integer 0..19, None (leave gloo's I/O "
                     "threads at the process's priority) or 'default' (PIPECAST_GLOO_IO_NICE, else 19)")


def default_nice() -> Optional[int]:
    """:func:`parse_nice` of ``PIPECAST_GLOO_IO_NICE``; a refused value gets a ``RuntimeWarning`` (the message of
    :func:`parse_nice`) and :data:`DEFAULT_NICE` instead of an error, because raising here would stop only the
    ranks that see the bad value while the others wait in ``new_group`` (``pipecast train`` refuses it earlier).
    """
    try:
        return parse_nice(os.environ.get(_ENV))
    except ValueError as exc:
        warnings.warn(f"{exc}; using {DEFAULT_NICE}", RuntimeWarning, stacklevel=2)
        return DEFAULT_NICE


def io_threads() -> set[int]:
    """Thread ids of this process's gloo I/O threads (empty where ``/proc/self/task`` is unavailable)."""
    found = set()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return found
    for tid in tids:
        try:
            if Path(f"/proc/self/task/{tid}/comm").read_text().strip() == IO_THREAD_NAME:
                found.add(int(tid))
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
    return found


def new_io_threads(before: set[int], expected: int, wait_s: float = NAME_WAIT_S) -> set[int]:
    """The gloo I/O threads not in ``before``, once ``expected`` of them carry their name (or after ``wait_s``
    seconds, whatever has appeared by then: a count that is never reached costs that wait, nothing else).

    Counting right after a group is created misses threads that have not run yet (they still carry their
    creator's name), so this polls; it never sleeps when ``expected`` are already there.
    """
    deadline = time.monotonic() + wait_s
    while True:
        found = io_threads() - before
        if len(found) >= expected or time.monotonic() >= deadline:
            return found
        time.sleep(0.001)


@contextlib.contextmanager
def lowered_io_priority(nice: Optional[int], expected: int = 1) -> Iterator[set[int]]:
    """Give the gloo I/O threads created inside the ``with`` block the nice value ``nice`` (None: do nothing).

    ``expected``: how many I/O threads the block creates on this rank (one per gloo group it joins); the renice
    waits until that many have named themselves (:func:`new_io_threads`).  Yields the set of thread ids that were
    reniced, filled when the block ends.  Only raises what the block raises.
    """
    changed: set[int] = set()
    before = io_threads() if nice is not None else set()
    try:
        yield changed
    finally:
        if nice is not None:
            for tid in new_io_threads(before, expected):
                try:
                    if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                        os.setpriority(os.PRIO_PROCESS, tid, nice)
                        changed.add(tid)
                except OSError:
                    continue
