"""Forward overflow at run time: the watched sites, what a step's peaks say, and the repairs.

The compiled forward folds ``max |x|`` of every watched value into a slot of the scaler's
``peaks`` buffer (``autoscale.ops.watch``, inserted by ``autoscale/passes/dynamo/insert_overflow_checks.py``). This
module is the host side: :class:`ForwardSites` keeps which site each slot is (a graph node, named
by module path and op) and which sites were promoted to float32; :func:`diagnose` reads one step's
peaks and says which sites overflowed first (not merely downstream of another), which came near
float16's max, and which were non-finite though computed in float32; ``ForwardSites.repair``
promotes what it can and says what it cannot. ``autoscale.repair.ForwardRepair`` decides, for the
``GradScaler``, when to read the peaks, and warns or raises when a repair is stuck.

A site is one of three kinds:

* ``float16``: a value computed in float16 (a GEMM, an elementwise op); non-finite means it
  overflowed, unless a watched value it is computed from was non-finite already;
* ``cast``: a float32 value about to be cast into float16 (the watch reads the float32 source, so
  it sees the magnitude the cast will lose: above 65504, the cast makes inf). A mask's sentinel
  (``finfo(float32).min``) is such a value too, and harmless: it becomes -inf, which softmax
  takes. So a cast above float16's range is blamed only on a step that was skipped;
* ``float32``: a value computed in float32 (deny ops, graph outputs, ops kept in float32 for
  overflow); non-finite there is not float16's doing (log(0), a bad batch).

The step's skip is decided as before, on the device, from the gradients; the forward peaks say
*why*. When a graph output is non-finite, the gradients' inf/nan is the forward's doing, and no
layer's gradient scale backs off (``outputs_nonfinite``).

A site's key is ``<module path>:<op>#<k>`` (the k-th such op of that module, in graph order): it
names the same node in every compile of the same model, so a promotion learnt at step 12 applies
to the recompiled graph, to a resumed run and to ``autoscale diff``. A cast is watched as
``<key of its source>@float16``; promoting it keeps its source out of float16.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

from autoscale.protocol import FP16_MAX, PROMOTED_SEP

__all__ = ["CAST_SUFFIX", "OVERFLOW_REASON", "Diagnosis", "ForwardSites", "NonFiniteForwardError", "Promotion",
           "Repair", "Site", "SiteKind", "alarm", "describe", "diagnose", "outputs_nonfinite"]

log = logging.getLogger("autoscale")

CAST_SUFFIX = "@float16"
OVERFLOW_REASON = "forward overflow"
"""How every reason for keeping a value in float32 for forward overflow begins (reports match on it)."""
SiteKind = Literal["float16", "cast", "float32"]


class NonFiniteForwardError(FloatingPointError):
    """The forward is non-finite in float32 too (or past every repair): not a float16 problem."""


@dataclass(frozen=True)
class Site:
    """One watched forward value.

    ``key`` names it (see the module docstring), ``kind`` says what its peak means (ibid.),
    ``predicted`` is the analysis' max |x| (None: unknown), ``reason`` why it is watched,
    ``upstream`` the slots of the nearest watched sites it is computed from (to tell an overflow
    from its consequences), ``output`` whether it is a graph output, ``where`` the line of the
    model's code that computes it (for messages).
    """

    key: str
    layer: str
    op: str
    kind: SiteKind
    predicted: float | None
    reason: str
    upstream: tuple[int, ...] = ()
    output: bool = False
    where: str = ""

    @property
    def promotes(self) -> str:
        """The key a repair adds to the promoted set: a cast's source, else the site itself."""
        return self.key.removesuffix(CAST_SUFFIX)

    @property
    def precision(self) -> str:
        return {"float16": "float16", "cast": "float32 -> float16", "float32": "float32"}[self.kind]

    def bad(self, peak: float) -> bool:
        """Whether the value, as its readers get it, is non-finite."""
        return not peak <= FP16_MAX if self.kind == "cast" else not math.isfinite(peak)

    def near(self, peak: float, threshold: float) -> bool:
        """Whether a float16 value came above ``threshold`` x 65504 and stayed finite."""
        limit = FP16_MAX if self.kind == "cast" else math.inf  # (a cast source above 65504 became inf)
        return self.kind != "float32" and threshold * FP16_MAX < peak < math.inf and peak <= limit


@dataclass(frozen=True)
class Promotion:
    """A site moved to float32 at run time: when, and what was seen (``observed``: its max |x|,
    inf or nan)."""

    key: str
    step: int
    observed: float
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "step": self.step, "observed": _jsonable(self.observed), "reason": self.reason}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Promotion:
        return Promotion(str(d["key"]), int(d["step"]), float(d["observed"]), str(d["reason"]))


@dataclass
class ForwardSites:
    """The watched sites of the graphs compiled against one scaler state, and the promotions.

    ``slots`` maps a site key to its slot in the peaks buffer (stable across recompiles). Per slot,
    on the device: ``alarm_low`` and ``alarm_high`` bound the peaks that call for a look on the
    host (a float16 value above ``threshold`` x 65504, a cast source in (threshold x 65504, 65504],
    nan anywhere), and ``outputs`` marks the graph outputs. (No check writes an unused slot.)
    """

    capacity: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    threshold: float = 0.5
    sites: list[Site] = field(default_factory=list)
    slots: dict[str, int] = field(default_factory=dict)
    promoted: dict[str, Promotion] = field(default_factory=dict)
    recompiles: int = 0
    unwatched: int = 0  # sites beyond capacity

    def __post_init__(self) -> None:
        self.alarm_low = torch.full((self.capacity,), math.inf, device=self.device)
        self.alarm_high = torch.full((self.capacity,), math.inf, device=self.device)
        self.outputs = torch.zeros(self.capacity, dtype=torch.bool, device=self.device)

    @property
    def promoted_key(self) -> str:
        """The promoted keys as one string: the forward hands it to ``attach``, Dynamo guards on it."""
        return PROMOTED_SEP.join(sorted(self.promoted))

    def register(self, site: Site, threshold: float) -> int | None:
        """The slot of ``site`` (a new one for a new key), its entry updated to this compile; None
        when the buffer is full (the site is then not watched, and reported once)."""
        self.threshold = threshold
        slot = self.slots.get(site.key)
        if slot is None:
            if len(self.sites) >= self.capacity:
                self.unwatched += 1
                return None
            slot = len(self.sites)
            self.slots[site.key] = slot
            self.sites.append(site)
        else:
            self.sites[slot] = site
        self.alarm_low[slot] = math.inf if site.kind == "float32" else threshold * FP16_MAX
        self.alarm_high[slot] = FP16_MAX if site.kind == "cast" else math.inf
        self.outputs[slot] = site.output
        return slot

    def follow(self, device: torch.device) -> None:
        """Keep the per-slot tensors where the peaks are (``model.to(device)`` moves the buffer)."""
        if self.outputs.device != device:
            self.alarm_low, self.alarm_high, self.outputs = (
                t.to(device) for t in (self.alarm_low, self.alarm_high, self.outputs))

    def promote(self, promotions: Iterable[Promotion]) -> list[Promotion]:
        """Add ``promotions`` (new keys only); returns those added."""
        added = [p for p in promotions if p.key not in self.promoted]
        for p in added:
            self.promoted[p.key] = p
        return added

    def state_dict(self) -> dict[str, Any]:
        """The promotions and the recompiles spent: what a resumed run must not relearn."""
        return {"promoted": [p.as_dict() for p in self.promoted.values()], "recompiles": self.recompiles}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.promoted = {p.key: p for p in map(Promotion.from_dict, state.get("promoted", ()))}
        self.recompiles = int(state.get("recompiles", 0))

    def dump(self) -> dict[str, Any]:
        """``state_dict`` plus the sites in slot order, for a saved converted graph (its checks
        write fixed slots)."""
        return {**self.state_dict(), "threshold": self.threshold, "sites": [asdict(s) for s in self.sites]}

    def restore(self, dumped: Mapping[str, Any]) -> None:
        """The inverse of ``dump``, into a new state."""
        self.load_state_dict(dumped)
        for site in dumped.get("sites", ()):
            self.register(Site(**{**site, "upstream": tuple(site["upstream"])}), float(dumped["threshold"]))

    def repair(self, peaks: torch.Tensor, *, skipped: bool, step: int, max_recompiles: int) -> Repair:
        """Diagnose one step's ``peaks`` and promote what overflowed or came near float16's max
        (one recompile for them all, within ``max_recompiles``). On a skipped step, also say what
        promotion cannot help, and why (``Repair.stuck``)."""
        found = diagnose(self.sites, peaks, self.threshold, skipped=skipped)
        wanted: dict[str, Promotion] = {}
        for i in (*found.overflowed, *found.near):
            key, why = self.sites[i].promotes, "overflowed" if i in found.overflowed else "near float16's max"
            wanted.setdefault(key, Promotion(key, step, found.peaks[i], why))
        new = [p for key, p in wanted.items() if key not in self.promoted]
        added: list[Promotion] = []
        if new and self.recompiles < max_recompiles:
            added = self.promote(new)
            self.recompiles += 1
        repaired = {p.key for p in added}
        unrepaired = tuple(i for i in found.overflowed if self.sites[i].promotes not in repaired)
        stuck = ""
        if skipped and found.float32:
            stuck = (f"{self.describe_slots(found, found.float32)}; computed in float32, so promoting cannot help: "
                     "this is a model or data problem (log or division of 0, sqrt of a negative, an inf/nan in the "
                     "batch)")
        elif skipped and unrepaired and all(self.sites[i].promotes in self.promoted for i in unrepaired):
            stuck = (f"{self.describe_slots(found, unrepaired)}; already promoted, but this graph still computes it in "
                     "float16: a graph after a graph break is not recompiled for a promotion (compile the model "
                     "without graph breaks), and a loaded converted module keeps its saved graph (convert the "
                     "model again: autoscale.convert applies the scaler's promotions)")
        elif skipped and unrepaired:
            stuck = (f"{self.describe_slots(found, unrepaired)}; not promoted: "
                     f"OverflowConfig.max_recompiles={max_recompiles} spent")
        return Repair(found, tuple(added), stuck)

    def describe_slots(self, found: Diagnosis, slots: Iterable[int]) -> str:
        """The sites at ``slots`` with what this step saw, for messages."""
        return "; ".join(describe(self.sites[i], found.peaks[i]) for i in slots)

    def events(self, repair: Repair) -> dict[str, Any]:
        """What ``repair`` found and did, as the telemetry records it."""
        found = repair.found
        return {"promoted": [p.as_dict() for p in repair.added],
                "overflowed": [self.sites[i].key for i in found.overflowed],
                "float32_nonfinite": [self.sites[i].key for i in found.float32]}

    def float32_sites(self) -> list[Site]:
        """The sites computed in float32 because of forward overflow (predicted or learnt)."""
        return [s for s in self.sites if s.kind == "float32" and s.reason.startswith(OVERFLOW_REASON)]


def alarm(peaks: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool on the device: whether any peak is above its slot's ``low`` and not above its
    ``high``, or nan (``ForwardSites`` sets the bounds per slot)."""
    return (~(peaks <= low) & ~(peaks > high)).any()


def outputs_nonfinite(peaks: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool on the device: whether a slot marked in ``outputs`` (a graph output) was non-finite."""
    return (~(peaks < math.inf) & outputs).any()


@dataclass(frozen=True)
class Diagnosis:
    """What one step's peaks say (slots are indices into ``ForwardSites.sites``).

    ``overflowed``: sites whose float16 value overflowed first (computed in float16, or cast into
    it from a finite float32 value on a skipped step); ``near``: float16 values finite but above
    the threshold; ``float32``: on a skipped step, values non-finite in float32 though none of
    their watched inputs was (where a non-finite value float16 did not cause began).
    """

    peaks: dict[int, float]
    overflowed: tuple[int, ...]
    near: tuple[int, ...]
    float32: tuple[int, ...]


@dataclass(frozen=True)
class Repair:
    """What ``ForwardSites.repair`` did with one step's peaks: the diagnosis, the promotions it
    added, and, on a skipped step that promotion cannot fix, what and why (else "")."""

    found: Diagnosis
    added: tuple[Promotion, ...]
    stuck: str


def diagnose(sites: Sequence[Site], peaks: torch.Tensor, threshold: float, *, skipped: bool) -> Diagnosis:
    """Read one step's ``peaks`` (a host tensor, one value per slot) against ``sites``; ``skipped``
    says whether the step's gradients were non-finite (see the module docstring)."""
    values = peaks[: len(sites)].tolist()
    bad = {i for i, (s, v) in enumerate(zip(sites, values, strict=True)) if s.bad(v)}
    origins = [i for i in sorted(bad) if not any(u in bad for u in sites[i].upstream)]
    overflowed, float32 = [], []
    for i in origins:
        site, peak = sites[i], values[i]
        if site.kind == "float16":
            overflowed.append(i)
        elif not skipped:
            continue  # a mask's sentinel cast to -inf, a float32 -inf (log_softmax) the step did not mind
        elif site.kind == "cast" and math.isfinite(peak):
            overflowed.append(i)  # a finite float32 value the cast made inf
        else:
            float32.append(i)
    return Diagnosis(
        peaks=dict(enumerate(values)),
        overflowed=tuple(overflowed),
        near=tuple(i for i, (s, v) in enumerate(zip(sites, values, strict=True)) if s.near(v, threshold)),
        float32=tuple(float32),
    )


def describe(site: Site, peak: float) -> str:
    """``encoder.0.ff.wo (linear, float16): inf [models.py:81: return self.wo(...)]``, for messages."""
    seen = "nan" if math.isnan(peak) else "inf" if math.isinf(peak) else f"max |x| {peak:.3g}"
    where = f" [{site.where}]" if site.where else ""
    return f"{site.layer or '(root)'} ({site.op}, {site.precision}): {seen}{where}"


def _jsonable(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)
