"""Runtime state the compiled graphs read and write: per-layer scales and statistics.

The state lives on the user's model as non-persistent buffers (they stay out of the model's
``state_dict``; the scaler saves them). Dynamo lifts buffers into graph inputs, so updating a
scale in place never recompiles, and the compiled backward writes its statistics straight into
``stats`` with no host synchronisation.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel
from torch.utils.weak import WeakIdKeyDictionary

from autoscale.overflow import ForwardSites
from autoscale.protocol import ANY_NONFINITE, FP16_MAX, LAYOUT_SEP, LOSS_ROW, NUM_STATS, STAT

__all__ = ["IdentitySet", "ScaleState", "announce_in_forward", "compile_in_place",
           "install_state", "owner_of", "recoded_forward", "state_of", "unwrap"]

_LOSS_NAME = "<loss>"
_STATE_ATTR = "_autoscale_state"
_SCALES, _STATS, _PEAKS = "_autoscale_scales", "_autoscale_stats", "_autoscale_peaks"


class ScaleState:
    """Row 0 is the loss scale; row ``i`` > 0 belongs to the module named ``layers[i]``.

    The tensors are non-persistent buffers of the model's root module (not a submodule: a
    container such as ``nn.Sequential`` calls every child), looked up by name on each access so
    that ``model.to(device)`` carries them along.
    """

    def __init__(self, root: nn.Module, layer_names: Sequence[str], *, moments: bool = False) -> None:
        self.root = root
        self.moments = moments  # record Σ g and Σ g² (the paper rule reads them)
        # Tensors whose gradients a compiled graph checks for inf/nan as it unscales them (the
        # backend registers them), so GradScaler.step need not read them again.
        self.checked = IdentitySet()
        self.graphs = 0  # graphs the backend compiled against this state
        self.inductor_graphs = 0  # of which compiled by Inductor (the scaler then compiles its update)
        self.scaled_graphs = 0  # of which with scale points (none in bfloat16: nothing to scale)
        self.gradient_max = FP16_MAX  # the smallest max of the formats the graphs round gradients to
        self.seeded: set[int] = set()  # rows whose scale a graph's analysis or a loaded state_dict set
        self.measured_rows: set[int] = set()  # rows a graph's scale points record statistics in
        # One statistics tensor per graph that the forward's announcement does not reach (a graph
        # after a graph break): each graph's backward writes its own, so that no graph's backward
        # modifies a tensor another graph saved for its backward. ``gather`` folds them in.
        self.graph_stats: list[torch.Tensor] = []
        self.layers: tuple[str, ...] = (_LOSS_NAME, *layer_names)
        self.layout = LAYOUT_SEP.join(self.layers)
        self.instance = _new_instance()  # (``autoscale.ops.attach``: a graph per state, copies included)
        # whether the coming step's backward measures its gradients (``ScalingConfig.measure_every``;
        # the GradScaler sets it): the forward announces it, and a graph is compiled for each value
        self.measuring = True
        device = next((p.device for p in root.parameters()), torch.device("cpu"))
        scales = torch.ones(len(self.layers), device=device)  # the backend seeds layers from its analysis
        root.register_buffer(_SCALES, scales, persistent=False)
        root.register_buffer(_STATS, torch.zeros(len(self.layers), NUM_STATS, device=device), persistent=False)
        # The forward's overflow checks: max |x| of each watched value this step, one slot per site
        # (a fixed capacity: resizing a graph input would recompile). Sites beyond it go unwatched.
        capacity = 8 * len(self.layers) + 256
        root.register_buffer(_PEAKS, torch.zeros(capacity, device=device), persistent=False)
        self.forward = ForwardSites(capacity, device)
        # Per rank, not broadcast by a DistributedDataParallel wrapped around root later: the
        # GradScaler reduces them across ranks itself, at the points where the ranks must agree.
        ignored = getattr(root, "_ddp_params_and_buffers_to_ignore", ())
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(root, [*ignored, _SCALES, _STATS, _PEAKS])
        _STATES[scales] = self
        self._registered = scales  # the scales tensor registered in _STATES (``scales``)
        self._any_view: torch.Tensor | None = None
        for p in root.parameters():
            _OWNERS[p] = weakref.ref(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> ScaleState:
        """The state of a copy of the model (``copy.deepcopy(model)``: an EMA model, a reference):
        the same layers, scales, statistics (the copy's buffers) and forward-overflow promotions,
        and no compiled graph yet. It is registered when first looked for (``_adopt_copies``):
        while the model is being copied, its buffers are not in place yet."""
        new = object.__new__(ScaleState)
        memo[id(self)] = new
        _fresh_frames(self.root, memo)
        fresh = {"checked": IdentitySet(), "graphs": 0, "inductor_graphs": 0, "scaled_graphs": 0, "graph_stats": [],
                 "_registered": None, "_any_view": None, "instance": _new_instance()}
        for key, value in vars(self).items():
            setattr(new, key, fresh[key] if key in fresh else copy.deepcopy(value, memo))
        _COPIES.add(new)
        return new

    def name_of(self, param: torch.Tensor) -> str | None:
        """``param``'s name in the model (``fc1.weight``), or None if it is not the model's."""
        return next((name for name, p in self.root.named_parameters() if p is param), None)

    def load(self, scales: torch.Tensor, stats: torch.Tensor) -> None:
        """Set the scales and statistics saved from a state of this layout. Scales whose loss row is
        not 1 are refused: no layer's row is row 0, and the points take it as 1 (``LOSS_ROW``)."""
        loss_scale = float(scales[LOSS_ROW])
        if loss_scale != 1.0:
            raise ValueError(f"the saved scales give the loss row (row {LOSS_ROW}) {loss_scale}, where autoscale "
                             "saves 1: they were edited, or are not a state of this model")
        with torch.no_grad():
            self.scales.copy_(scales)
            self.stats.copy_(stats)

    def stats_for_graph(self) -> torch.Tensor:
        """A new statistics tensor for one graph the announcement does not reach (see ``gather``)."""
        stats = torch.zeros_like(self.stats)
        self.graph_stats.append(stats)
        return stats

    def gather(self) -> None:
        """Fold the per-graph statistics into ``stats`` (max for the largest gradient, sums
        otherwise) and clear them; the scaler calls it before it reads ``stats``."""
        stats = self.stats
        for extra in self.graph_stats:
            extra = extra.to(stats.device)
            amax = stats[:, STAT["amax"]].clone()
            stats.add_(extra)
            stats[:, STAT["amax"]] = torch.maximum(amax, extra[:, STAT["amax"]])
            extra.zero_()

    def holds(self, scales: torch.Tensor, stats: torch.Tensor, peaks: torch.Tensor) -> bool:
        """Whether the model's buffers are these tensors (``model.to`` replaces them), read from
        the module's buffer dict: the scaler asks at every steady-state update, right after a
        backward, where ``nn.Module.__getattr__`` is slow with cold caches."""
        buffers = self.root._buffers
        return buffers.get(_SCALES) is scales and buffers.get(_STATS) is stats and buffers.get(_PEAKS) is peaks

    @property
    def scales(self) -> torch.Tensor:
        scales: torch.Tensor = getattr(self.root, _SCALES)
        if scales is not self._registered:  # moved (``model.to``): the backend finds the state by this tensor
            _STATES[scales] = self
            self._registered = scales
        return scales

    @property
    def stats(self) -> torch.Tensor:
        return getattr(self.root, _STATS)

    @property
    def any_nonfinite(self) -> torch.Tensor:
        """A 0-dim view of ``stats``: positive when a graph's backward saw a non-finite value this step."""
        stats = self.stats
        if self._any_view is None or self._any_view._base is not stats:
            self._any_view = stats.view(-1)[ANY_NONFINITE]
        return self._any_view

    @property
    def peaks(self) -> torch.Tensor:
        return getattr(self.root, _PEAKS)


class IdentitySet:
    """Tensors by identity, held weakly. Membership is one dict lookup: a ``WeakIdKeyDictionary``
    builds a weak reference for every lookup (a cost per parameter at every ``GradScaler.step``)."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[torch.Tensor]] = {}

    def add(self, tensor: torch.Tensor) -> None:
        key, refs = id(tensor), self._refs
        self._refs[key] = weakref.ref(tensor, lambda _: refs.pop(key, None))

    def __contains__(self, tensor: object) -> bool:
        ref = self._refs.get(id(tensor))
        return ref is not None and ref() is tensor

    def __len__(self) -> int:
        return len(self._refs)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for ref in list(self._refs.values()):
            if (tensor := ref()) is not None:
                yield tensor


_STATES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # scales tensor -> its ScaleState
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> weakref to its model's ScaleState
_COPIES: weakref.WeakSet[ScaleState] = weakref.WeakSet()  # states of copied models, not registered yet
_INSTANCES = itertools.count()
_FRAMES = itertools.count()


def _new_instance() -> str:
    """A name no other ScaleState of this process has (``ScaleState.instance``)."""
    return str(next(_INSTANCES))


def _adopt_copies() -> None:
    """Register the states of models copied since the last look (see ``ScaleState.__deepcopy__``)."""
    for state in list(_COPIES):
        _COPIES.discard(state)
        _STATES[state.scales] = state
        for p in state.root.parameters():
            _OWNERS[p] = weakref.ref(state)


def owner_of(param: torch.Tensor) -> ScaleState | None:
    """The ScaleState of the model that ``param`` belonged to when the state was installed, or
    that has it now.

    The second, for FSDP2: ``fully_shard`` keeps a module's sharded parameters registered between
    forwards (the ones the state saw) and swaps in unsharded ones for the forward, which are the
    ones a compiled graph takes as inputs; while they are in place, the model names them. The
    answer is remembered (FSDP2 reuses the unsharded parameter objects from step to step).
    """
    _adopt_copies()
    ref = _OWNERS.get(param)
    state = ref() if ref is not None else None
    if isinstance(state, ScaleState):
        return state
    for candidate in {id(s): s for s in list(_STATES.values()) if isinstance(s, ScaleState)}.values():
        if candidate.name_of(param) is not None:
            _OWNERS[param] = weakref.ref(candidate)
            return candidate
    return None


def state_of(scales: torch.Tensor) -> ScaleState | None:
    """The ScaleState whose scales tensor this is (None if it is no longer any state's)."""
    _adopt_copies()
    state = _STATES.get(scales)
    return state if isinstance(state, ScaleState) and state.scales is scales else None


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module behind ``torch.compile``'s and data parallelism's wrappers (Dynamo
    compiles the module a DistributedDataParallel wraps, not the wrapper's forward)."""
    *_, root = _wrapped_chain(model)
    return root


def _wrapped_chain(model: nn.Module) -> Iterator[nn.Module]:
    """``model``, then each module it wraps in turn (``unwrap``), the user's module last."""
    while True:
        yield model
        if isinstance(model, (DistributedDataParallel, DataParallel)):
            model = model.module
        elif isinstance(inner := getattr(model, "_orig_mod", None), nn.Module):
            model = inner
        else:
            return


def install_state(model: nn.Module, *, moments: bool = False) -> ScaleState:
    """Give ``model`` a ScaleState (a row per named module) and make its forward announce the
    state to the backend. Idempotent: a second call returns the installed state (asking it for
    ``moments`` too, if this call does; graphs compiled before keep what they record)."""
    root = unwrap(model)
    existing = getattr(root, _STATE_ATTR, None)
    if isinstance(existing, ScaleState):
        existing.moments |= moments
        return existing
    state = ScaleState(root, [name for name, _ in root.named_modules()], moments=moments)
    object.__setattr__(root, _STATE_ATTR, state)  # a plain attribute, not a submodule
    announce_in_forward(model, _attach)
    return state


def _attach(m: nn.Module) -> None:
    """``install_state``'s announcement: ``m``'s state, looked up on ``m`` (a copy has its own)."""
    state = getattr(m, _STATE_ATTR)
    torch.ops.autoscale.attach(getattr(m, _SCALES), getattr(m, _STATS), getattr(m, _PEAKS), state.layout,
                               state.moments, state.forward.promoted_key, state.instance, state.measuring)


def announce_in_forward(model: nn.Module, announce: Callable[[nn.Module], None]) -> None:
    """Make the forward of ``model``'s module (``unwrap``: ``root``) call ``announce(root)`` first:
    a marker op (``autoscale::attach``, ``autoscale::attach_quant``) on a runtime state's buffers,
    through which Dynamo lifts them into the graph as inputs and a pass finds them. The buffers are
    looked up at each call, so that ``model.to(device)`` carries them along.

    The forward is a ``functools.partial`` of ``_announced`` over ``root``, not a closure:
    ``copy.deepcopy(model)`` copies a partial's arguments, ``root`` becoming the copy, so a copy
    runs its own forward (a closure would silently run the original's). And Dynamo's first frame is
    ``_announced``, with ``root`` a local: the graph's inputs are named after it (``l_root_...``).

    Each model's ``_announced`` has a code object of its own (``_frame``), and Dynamo starts from
    it: Dynamo keeps a frame's compiled graphs on its code object and stops compiling a frame at
    ``torch._dynamo.config.recompile_limit`` graphs (8). Every model recompiles (its state is its
    own: ``ScaleState.instance``), so through one shared frame the ninth model trained with a
    scaler in a process (a sweep, a notebook cell run again) silently ran eagerly, unscaled. The
    code object has a name of its own too: Dynamo keeps what it learnt of a frame's input shapes
    (automatic dynamic shapes) by file, line and name, so through one shared name each model's
    first compile was made dynamic by the shapes the models before it were called with (a CNN
    after another at another image size: a symbolic image size), where ``torch.compile`` of each
    model, starting from its own class's forward, compiles static shapes.
    ``torch.compile`` of a ``torch.nn`` module (an ``nn.Sequential``) starts Dynamo from a frame
    of its own that every such model shares, chosen when it wrapped the model: a wrapper in
    ``model``'s chain is made to choose again (``_rewrap``), now that the forward is autoscale's."""
    root = unwrap(model)
    inner = root.__dict__.get("forward")  # a forward set on the instance, or None for its class's
    wrapped = inner if inner is not None else root.forward
    forward = functools.partial(_frame(cast(types.FunctionType, _announced)), root, announce, inner)
    functools.update_wrapper(forward, wrapped)
    del forward.__wrapped__  # type: ignore[attr-defined]  # (a bound method of the original: a copy would keep it)
    forward.__signature__ = inspect.signature(wrapped)  # type: ignore[attr-defined]  # (Trainers read it)
    root.__dict__.pop("forward", None)  # (set last: ``_fresh_frames`` needs the states copied first)
    root.forward = forward
    _rewrap(model)


def _fresh_frames(root: nn.Module, memo: dict[int, Any]) -> None:
    """Make ``copy.deepcopy`` give a copy of ``root`` an ``_announced`` of its own, through its
    ``memo`` (``ScaleState.__deepcopy__``, which runs before the forward is copied: the state was
    set on ``root`` first). ``deepcopy`` copies a partial's function as itself, so every copy would
    share the original's frame, and its compiled graphs and their recompile limit with it
    (``announce_in_forward``)."""
    forward = root.__dict__.get("forward")
    while isinstance(forward, functools.partial) and _is_announced(forward.func):
        memo.setdefault(id(forward.func), _frame(cast(types.FunctionType, forward.func)))
        forward = forward.args[2]  # (``inner``: an announcement made before, or None)


def _is_announced(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is ``_announced`` or a ``_recoded`` one."""
    return getattr(fn, "__module__", None) == __name__ and getattr(fn, "__qualname__", None) == _announced.__qualname__


def _rewrap(model: nn.Module) -> None:
    """Have each ``torch.compile`` wrapper between ``model`` and its module choose the frame
    Dynamo starts from again (``OptimizedModule._initialize``, which its unpickling also calls):
    for a ``torch.nn`` module's own forward it chose a frame shared by all such models; for
    autoscale's forward it chooses ``_announced``. Without the method (another torch), nothing."""
    for wrapper in _wrapped_chain(model):
        initialize = getattr(wrapper, "_initialize", None)
        if callable(initialize) and hasattr(wrapper, "dynamo_ctx"):
            initialize()


def _announced(root: nn.Module, announce: Callable[[nn.Module], None], inner: Callable[..., Any] | None,
               *args: Any, **kw: Any) -> Any:
    announce(root)
    if inner is not None:
        return inner(*args, **kw)
    return type(root).forward(root, *args, **kw)


def recoded_forward(module: nn.Module) -> Callable[..., Any]:
    """``module.forward``, with a code object of its own for the function Dynamo starts from.

    Dynamo keeps compiled graphs per code object. Through a shared one (a class's forward, or a
    model's ``_announced``, which its training compiles), each capture with a new backend would
    add an entry until the recompile limit stops compiling, and clearing that cache would drop the
    user's own compiled code too. A fresh code object starts with an empty cache and takes it along
    when it is freed. The function is otherwise the same, so Dynamo names the graph's modules as it
    does for ``torch.compile(model)``. ``TypeError`` when the forward is not Python code.
    """
    forward = module.forward
    if isinstance(forward, functools.partial) and isinstance(forward.func, types.FunctionType):
        fresh = functools.partial(_recoded(forward.func), *forward.args, **forward.keywords)
        fresh.__dict__.update(forward.__dict__)
        return fresh
    bound_to = getattr(forward, "__self__", None)
    fn = getattr(forward, "__func__", forward)
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"{type(module).__name__}.forward is a {type(fn).__name__}, not a Python function")
    return _recoded(fn) if bound_to is None else types.MethodType(_recoded(fn), bound_to)


def compile_in_place(module: nn.Module, backend: Callable[..., Any]) -> None:
    """``module.compile(backend=backend)`` that compiles ``torch.nn``'s own modules too, each module
    from a frame of its own: calling ``module`` (``self.encoder(x)``) runs it compiled, and the
    module stays itself (its ``state_dict`` keys, its attributes).

    ``nn.Module.compile`` compiles ``_call_impl``, a frame of torch's own that Dynamo skips: it
    starts from the frames called below, the class's ``forward``, which for an ``nn.Sequential``
    is torch's too, so nothing is compiled; and a user class's ``forward`` is one frame for all its
    instances, with one recompile limit and one automatic-dynamic state (``announce_in_forward``).
    Here Dynamo starts from ``_unit_<n>``, ``_call_unit`` recoded for this module, and inlines the
    rest, as ``torch.compile(module)`` does; a copy of the module (``copy.deepcopy``) is called
    through a copy of the partial, on itself."""
    frame = _recoded(cast(types.FunctionType, _call_unit), name=f"_unit_{next(_FRAMES)}")
    module._compiled_call_impl = torch.compile(functools.partial(frame, module), backend=backend)


def _call_unit(module: nn.Module, *args: Any, **kw: Any) -> Any:
    return module._call_impl(*args, **kw)


def _frame(announced: types.FunctionType) -> types.FunctionType:
    """``_announced`` as one model's frame: a code object of its own, named ``_announced_<n>``."""
    return _recoded(announced, name=f"{_announced.__name__}_{next(_FRAMES)}")


def _recoded(fn: types.FunctionType, *, name: str | None = None) -> types.FunctionType:
    """``fn`` with a new code object, equal to its own but for the code's ``name`` if given."""
    code = fn.__code__.replace() if name is None else fn.__code__.replace(co_name=name)
    recoded = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    recoded.__kwdefaults__ = fn.__kwdefaults__
    recoded.__qualname__ = fn.__qualname__
    recoded.__dict__.update(fn.__dict__)  # functools.wraps' attributes and the like
    return recoded
