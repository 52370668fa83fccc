"""Count the host's reads of tensor values: each one waits for the device (a sync) on a GPU.

    with HostReads(exempt=scaler) as reads:
        scaler.step(opt); scaler.update()
    reads.count                      # item(), bool(), float(), tolist(), numpy(), .cpu() of a CUDA tensor

On a CPU nothing waits, but the same calls run: counting them there tells what a GPU would sync
on. Reads of a ``HostMirror``'s host buffers (``exempt``: a GradScaler, or mirrors) are not
counted: an asynchronous copy filled them, and reading one never waits for the device.
``torch.cuda.set_sync_debug_mode`` is the GPU's own check; this one also runs on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autoscale.mirror import HostMirror

__all__ = ["HostReads"]

_PATCHED = ("tolist", "numpy")


def _blocking_copy_to_host(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether an aten call copies a device tensor to the host and waits for it. ``copy_`` takes
    ``non_blocking`` positionally (``args[2]``) at the dispatcher; ``_to_copy`` as a keyword."""
    if func is torch.ops.aten.copy_.default and len(args) >= 2:
        dst, src, non_blocking = args[0], args[1], len(args) > 2 and bool(args[2])
        dst_device = dst.device
    elif func is torch.ops.aten._to_copy.default and args:
        src, non_blocking, dst_device = args[0], kwargs.get("non_blocking", False), kwargs.get("device")
    else:
        return False
    return (not non_blocking and isinstance(src, torch.Tensor) and src.device.type != "cpu"
            and dst_device is not None and torch.device(dst_device).type == "cpu")


class HostReads(TorchDispatchMode):
    """A context that counts host reads of tensor values (see the module docstring)."""

    def __init__(self, exempt: Any = None) -> None:
        super().__init__()
        self.count = 0
        self.reads: list[str] = []
        mirrors = exempt if isinstance(exempt, Iterable) else [exempt] if exempt is not None else []
        self._mirrors = [m if isinstance(m, HostMirror) else getattr(m, "_mirror", None) for m in mirrors]
        self._originals: dict[str, Any] = {}
        self._inside = False  # (in a counted tolist/numpy: its own copy to the host is that read)

    def _exempt(self, t: torch.Tensor) -> bool:
        base = t._base if t._base is not None else t
        return any(base is b for m in self._mirrors if m is not None for b in m.buffers())

    def _note(self, what: str) -> None:
        self.count += 1
        self.reads.append(what)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and not self._exempt(args[0]):
            self._note("item")
        elif not self._inside and _blocking_copy_to_host(func, args, kwargs):
            self._note("copy to host")
        return func(*args, **kwargs)

    def __enter__(self) -> HostReads:
        for name in _PATCHED:
            original = getattr(torch.Tensor, name)
            self._originals[name] = original

            def counted(t: torch.Tensor, *a: Any, _original: Any = original, _name: str = name, **k: Any) -> Any:
                if not self._exempt(t):
                    self._note(_name)
                self._inside = True
                try:
                    return _original(t, *a, **k)
                finally:
                    self._inside = False

            setattr(torch.Tensor, name, counted)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        self._originals.clear()
