"""Copies of a small device tensor on the host, made without waiting for the device.

The device writes into ``HostMirror.destination(...)``; ``post()`` then starts copying it into
pinned host memory and records an event, and ``poll()`` hands back the copies whose event has
completed, oldest first. ``poll`` never waits, except when the device is ``depth`` copies behind,
when ``post`` waits for the oldest rather than lose it. So the host reads what the device decided
a step or two later, with no sync in between.

On a CPU the device's memory is the host's: the destination *is* a host buffer, there is nothing
to copy, and ``poll`` hands it back at once. The same calls run on both, so a test on a CPU runs
the code that runs on CUDA.

``values`` reads a host buffer's floats as Python floats with no torch op: the reader runs at every
step right after a backward, where every cold torch op is a measurable part of a small ``update()``.
"""

from __future__ import annotations

import ctypes
from collections import deque

import torch

__all__ = ["HostMirror"]


class HostMirror:
    """Asynchronous device-to-host copies, read in order (see the module docstring)."""

    def __init__(self, depth: int = 3) -> None:
        self.depth = depth
        self._pending: deque[tuple[torch.Tensor, torch.cuda.Event | None]] = deque()
        self._free: list[torch.Tensor] = []
        self._staging: torch.Tensor | None = None  # (CUDA) what the device writes, copied at ``post``
        self._views: dict[int, ctypes.Array[ctypes.c_float]] = {}  # id of a host buffer -> ``values``

    def destination(self, size: int, device: torch.device) -> torch.Tensor:
        """The float32 tensor of ``size`` the device should write the next copy into."""
        if device.type == "cpu":
            return self._host(size, pinned=False)
        if self._staging is None or self._staging.shape != (size,) or self._staging.device != device:
            self._staging = torch.zeros(size, device=device)
        return self._staging

    def post(self, written: torch.Tensor) -> None:
        """Hand ``written`` (the last ``destination``) over to the host."""
        if written.device.type == "cpu":
            self._pending.append((written, None))
            return
        if len(self._pending) >= self.depth:  # (the device is far behind: wait for the oldest)
            _, event = self._pending[0]
            if event is not None:
                event.synchronize()
        host = self._host(written.numel(), pinned=True)
        host.copy_(written, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((host, event))

    def poll(self) -> list[torch.Tensor]:
        """The copies that have arrived, oldest first. Each is valid until the next ``destination``."""
        done = []
        while self._pending and (self._pending[0][1] is None or self._pending[0][1].query()):
            buffer, _ = self._pending.popleft()
            done.append(buffer)
            self._free.append(buffer)
        return done

    def buffers(self) -> list[torch.Tensor]:
        """Every host buffer this mirror hands back (reading one never waits for the device)."""
        return [b for b, _ in self._pending if b.device.type == "cpu"] + self._free

    def values(self, buffer: torch.Tensor) -> ctypes.Array[ctypes.c_float]:
        """The values of ``buffer`` (one that ``poll`` handed back), read in place as Python floats,
        without a torch op (see the module docstring). Valid as long as ``buffer`` is."""
        return self._views[id(buffer)]

    def _host(self, size: int, *, pinned: bool) -> torch.Tensor:
        for i, buffer in enumerate(self._free):
            if buffer.numel() == size:
                return self._free.pop(i)
        buffer = torch.zeros(size, pin_memory=pinned)
        # (contiguous float32; an id is its buffer's while the buffer lives, and ``values`` is asked
        # only of buffers that ``poll`` hands back: all made here, where their entry is written)
        self._views[id(buffer)] = (ctypes.c_float * size).from_address(buffer.data_ptr())
        return buffer
