"""Count what makes the host wait on the device, on any machine (a CPU run included).

On a GPU the host runs ahead of the device until it needs a value the device computes: ``.item()``,
``float(t)`` / ``int(t)`` / ``bool(t)`` (an ``if`` on a tensor), ``.tolist()``, formatting a tensor, a copy to the
host, or a blocking copy to the device from pageable memory (the CUDA copy waits for the stream: ATen's
``copy_kernel_cuda`` synchronises unless ``non_blocking``).  ``torch.cuda.set_sync_debug_mode`` reports these on
a GPU; :class:`HostSyncCounter` counts the calls that cause them on the CPU too, so a test can hold a training step
to zero without a device (torchtitan's and nanoGPT's rule: the host reads figures only when it logs).

Counted, by kind (the keys of :attr:`HostSyncCounter.counts`):

* ``item``, ``tolist``, ``float``, ``int``, ``bool``, ``index``, ``format``, ``complex``: a Python value read from a
  tensor (``Tensor.item`` / ``tolist`` / ``__float__`` / ``__int__`` / ``__bool__`` / ``__index__`` /
  ``__format__`` / ``__complex__``);
* ``to_host``: ``Tensor.cpu()``, or ``Tensor.to("cpu", ...)`` (the host named by its string; ``Tensor.numpy()``
  is not counted: it refuses a device tensor, so it never waits on one);
* ``to_device``: ``Tensor.cuda()``, ``Tensor.to(device)`` to another device than the tensor's, and ``torch.tensor``
  / ``torch.as_tensor`` with a ``device`` (Python data copied to the device);
* ``synchronize``: ``torch.cuda.synchronize`` (patched while counting).

A copy with ``non_blocking=True`` is not counted (it queues on the stream; a pinned host buffer makes it truly
asynchronous).  On a CPU run every tensor is a host tensor, so a counted call is one that *would* wait on a GPU:
the count holds for both.  One blind spot: ``.to(device)`` with the run's ``torch.device`` changes nothing on a
CPU run and is not counted there (a host-to-device copy of a batch on a GPU); ``torch.cuda.set_sync_debug_mode``
covers it on a GPU.
"""
from __future__ import annotations

import collections
import contextlib
import traceback

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HostSyncCounter", "count_host_syncs", "SCALAR_READS"]

SCALAR_READS = {"item": "item", "tolist": "tolist", "__float__": "float", "__int__": "int", "__bool__": "bool",
                "__index__": "index", "__format__": "format", "__complex__": "complex"}
"""Tensor methods that return a Python value -> the kind they are counted as."""


def _device_arg(args, kwargs):
    """The device a ``Tensor.to`` call names (its ``device`` argument, a device / string / tensor positional), or
    None (a dtype-only conversion)."""
    if "device" in kwargs:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            return a
        if isinstance(a, torch.Tensor):
            return a.device
    return None


def _kind(func, args, kwargs) -> str | None:
    """The kind of host sync a torch function call is (see the module docstring), or None."""
    name = getattr(func, "__name__", "")
    if name in SCALAR_READS:
        return SCALAR_READS[name]
    if name == "cpu":
        return "to_host"
    if name == "cuda":
        return None if kwargs.get("non_blocking") else "to_device"
    if name in ("tensor", "as_tensor") and func in (torch.tensor, torch.as_tensor):
        return "to_device" if kwargs.get("device") is not None else None
    if name == "to" and args and isinstance(args[0], torch.Tensor):
        target = _device_arg(args, kwargs)
        if target is None or kwargs.get("non_blocking") or any(a is True for a in args[2:]):
            return None
        if isinstance(target, str) and torch.device(target).type == "cpu":
            return "to_host"
        target = torch.device(target)
        if target == args[0].device:
            return None
        return "to_host" if target.type == "cpu" else "to_device"
    return None


class HostSyncCounter(TorchFunctionMode):
    """A ``TorchFunctionMode`` counting the calls that make the host wait on the device (see the module
    docstring).  :attr:`counts` maps kind -> calls; :attr:`where` keeps, per kind, the innermost pipecast frame
    (``file:line``) of each call (the first 20), so a failing check names the line.  Use through
    :func:`count_host_syncs`."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.where: dict[str, list[str]] = collections.defaultdict(list)

    def record(self, kind: str) -> None:
        """Count one host sync of ``kind`` and keep (for the first 20) the pipecast line that made it."""
        self.counts[kind] += 1
        if len(self.where[kind]) < 20:
            frames = [f for f in traceback.extract_stack()[:-2] if "/host_syncs.py" not in f.filename]
            ours = [f for f in frames if "/engine/" in f.filename or "/graphs/" in f.filename] or frames
            self.where[kind].append(f"{ours[-1].filename}:{ours[-1].lineno}")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _kind(func, args, kwargs)
        if kind is not None:
            self.record(kind)
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        """Host syncs counted, all kinds."""
        return sum(self.counts.values())


@contextlib.contextmanager
def count_host_syncs():
    """``with count_host_syncs() as counter:`` counts, in this thread, the host syncs of the code inside
    (:class:`HostSyncCounter`); ``torch.cuda.synchronize`` is patched to count as ``synchronize``."""
    counter = HostSyncCounter()
    real = torch.cuda.synchronize

    def synchronize(device=None):
        counter.record("synchronize")
        return real(device)
    torch.cuda.synchronize = synchronize
    try:
        with counter:
            yield counter
    finally:
        torch.cuda.synchronize = real
