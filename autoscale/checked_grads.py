"""Which gradients are still exactly what a compiled backward checked for inf/nan.

In adaptive mode a compiled backward checks each parameter's gradient as it unscales it, and
``GradScaler.step`` need not read that gradient again: a pass over every gradient saved. But a
gradient may change between the backward and the step: a hand edit, a manual ``all_reduce``, a
DDP communication hook, a second backward accumulating into it, a tensor assigned from elsewhere.
torch.amp's contract, that a non-finite gradient is never applied, must hold for those too.

``CheckedGradients`` tells them apart on the host, from tensor identity and autograd's version
counter. At the start of a backward (a hook on the scaled loss) it notes which checked
parameters have no gradient yet; at its end (a callback the autograd engine runs once the whole
backward, hooks included, is done) it records the gradient each of them received, and its
version. A gradient is unchanged if it is still that tensor at that version: any in-place write
through the tensor or a view of it bumps the version, and an assignment replaces the tensor.
Anything else is checked again in ``step``:

* a parameter that had a gradient when the backward began (it accumulates: several backward
  calls before a step, ``zero_grad(set_to_none=False)``);
* a parameter with a gradient hook (it runs after the graph checked the gradient);
* every parameter of a backward that did not start from a scaled loss (``loss.backward()``
  without ``scaler.scale``).

Not seen: writes that bypass the version counter, which autograd does not see either:
``p.grad.data.fill_(...)`` (``.data`` has a counter of its own) and writes through memory shared
outside torch (NumPy, DLPack). Write through ``p.grad`` itself, as torch's own code does.
"""

from __future__ import annotations

import torch

from autoscale.runtime import IdentitySet

__all__ = ["CheckedGradients", "hooked"]


def hooked(p: torch.Tensor) -> bool:
    """Whether a gradient hook of ``p``'s runs after the graph has checked its gradient."""
    return bool(p._backward_hooks or p._post_accumulate_grad_hooks)


class CheckedGradients:
    """The gradients of ``checked`` parameters (those a compiled graph checks) as the last
    backward left them; see the module docstring."""

    def __init__(self, checked: IdentitySet) -> None:
        self._checked = checked
        self._left: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # id(p) -> (p, its grad, version)

    def backward_starts(self) -> None:
        """Note the checked parameters that have no gradient yet, and have the autograd engine
        record theirs when this backward ends. Called from a hook during the backward."""
        checked, left = list(self._checked), self._left
        fresh = [p for p in checked if p.grad is None]
        if left:  # (a second backward this step: what it accumulates into is no longer what was checked)
            for p in checked:
                if p.grad is not None:
                    left.pop(id(p), None)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._record(fresh))

    def _record(self, params: list[torch.Tensor]) -> None:
        left = self._left
        for p in params:
            if (grad := p.grad) is not None:
                left[id(p)] = (p, grad, grad._version)

    def unchanged(self, p: torch.Tensor) -> bool:
        """Whether ``p.grad`` is the gradient a compiled graph checked, as it left the backward (a
        gradient hook may still have changed it then: ``hooked``)."""
        left = self._left.get(id(p))
        if left is None:
            return False
        grad = p.grad
        return left[1] is grad and left[0] is p and grad._version == left[2]

    def clear(self) -> None:
        """Forget the recorded gradients: the step is over (``GradScaler.update``)."""
        self._left.clear()
