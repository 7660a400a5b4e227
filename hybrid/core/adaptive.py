"""The choice behind adapting to a link that changes: which mode the measured link and compute make fastest.

What the trainer measures between two choices (the inter-node phase's bytes and seconds, the compute seconds
per step) goes in; out comes the mode to run until the next choice:

- every step, ``hierarchical`` or ``sharded``, with the inter-node hop in fp32 or in 16 bits (half the bytes on
  the slow link; the node's own link stays fp32);
- ``diloco`` with a sync interval H: the nodes exchange the model's bytes once every H steps, and meanwhile
  average inside the node only.

:class:`LinkEstimate` turns the inter-node samples into a rate (a window's median: one step that waited on a
straggler does not move it), :func:`expected_step_s` prices a mode with the alpha-beta cost model
(:mod:`hybrid.core.costmodel`), :func:`diloco_sync_every` picks the smallest H whose exchange the link carries
within a share of the compute, and :class:`ModeChooser` takes the most faithful mode expected within a slack of the
fastest (DiLoCo only where every-step training would cost clearly more), with a margin and several choices
in a row before a switch, so that noise does not make it flap. Every input must be the same on
every rank (all-reduced measurements), so every rank switches at the same step.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, replace

from hybrid.core.costmodel import Level, Model, predict
from hybrid.core.topology import Layout

__all__ = ["MODE_MARGIN", "Interval", "LinkEstimate", "Mode", "ModeChooser", "ModePlan", "diloco_sync_every", "expected_step_s",
           "measured_step_s", "with_link"]

EVERY_STEP = ("hierarchical", "sharded")
MODE_MARGIN = 0.05  # the chooser's margin both ways around its slack, so that a mode near the line does not flap
COMPRESSIONS = ("none", "bf16")


@dataclass(frozen=True)
class Mode:
    """One way to run the job: ``algorithm`` every step, or ``diloco`` syncing every ``sync_every`` steps."""

    algorithm: str
    inter_compression: str = "none"
    sync_every: int = 1

    def __post_init__(self) -> None:
        if self.algorithm not in (*EVERY_STEP, "diloco"):
            raise ValueError(f"mode algorithm {self.algorithm!r} is not one of {', '.join((*EVERY_STEP, 'diloco'))}")
        if self.inter_compression not in COMPRESSIONS:
            raise ValueError(f"mode inter_compression {self.inter_compression!r} is not one of {', '.join(COMPRESSIONS)}")
        if self.sync_every < 1 or (self.algorithm != "diloco" and self.sync_every != 1):
            raise ValueError(f"mode sync_every={self.sync_every} must be 1 every step, or >= 1 with diloco")

    def __str__(self) -> str:
        name = f"diloco H={self.sync_every}" if self.algorithm == "diloco" else self.algorithm
        return name + ("+bf16" if self.inter_compression == "bf16" else "")

    @property
    def name(self) -> str:
        """What :meth:`parse` reads back (with ``sync_every`` beside it)."""
        return self.algorithm + ("+bf16" if self.inter_compression == "bf16" else "")

    @property
    def kind(self) -> tuple[str, str]:
        """The mode without DiLoCo's interval: the interval follows the link, the kind is what switches."""
        return self.algorithm, self.inter_compression

    @classmethod
    def parse(cls, text: str, sync_every: int = 1) -> Mode:
        """``hierarchical``, ``sharded``, ``diloco`` (at ``sync_every``), each with ``+bf16`` for the 16-bit hop."""
        algorithm, _, compression = str(text).partition("+")
        if algorithm not in (*EVERY_STEP, "diloco") or compression not in ("", "bf16"):
            raise ValueError(f"mode {text!r} is not one of {', '.join((*EVERY_STEP, 'diloco'))} (+bf16 for the "
                             "16-bit inter-node hop)")
        return cls(algorithm, compression or "none", sync_every if algorithm == "diloco" else 1)


class LinkEstimate:
    """The inter-node link's rate, Mbit/s, from ``(bytes, seconds)`` samples of the inter-node phase: the median
    of the last ``window`` samples of at least ``min_bytes`` (a few bytes time the latency, not the rate).

    A sample more than ``jump`` times off the median is held back: alone (a step that waited on a straggler) it
    moves nothing; followed by another that far off on the same side, the link has changed, and the window
    starts afresh from the two (they need not agree with each other: a short probe of a fast link reads it
    anywhere from half to several times its rate). A link that went from 500 to 20 Mbit/s is then known at its second sample, not once the old
    samples are outvoted."""

    def __init__(self, window: int = 5, min_bytes: int = 256 * 1024, jump: float = 3.0) -> None:
        if window < 1 or not jump > 1:
            raise ValueError(f"window={window} must be >= 1 and jump={jump} > 1")
        self.samples: deque[float] = deque(maxlen=window)
        self.min_bytes, self.jump = min_bytes, jump
        self.held: float | None = None  # a sample far off the median, waiting for a second opinion

    def add(self, nbytes: float, seconds: float) -> None:
        if nbytes < self.min_bytes or seconds <= 0:
            return
        rate = nbytes * 8 / seconds / 1e6
        median = self.mbit
        if median is None or median / self.jump <= rate <= median * self.jump:
            self.held = None
            self.samples.append(rate)
        elif self.held is not None and (self.held > median) == (rate > median):
            self.samples.clear()  # a second sample off the same side: the link changed
            self.samples.extend((self.held, rate))
            self.held = None
        else:
            self.held = rate

    def forget(self) -> None:
        """Drop the samples: after a switch, the link is measured anew under the new mode."""
        self.samples.clear()
        self.held = None

    @property
    def mbit(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None


def with_link(model: Model, mbit: float) -> Model:
    """``model`` with its inter-node level at the measured rate (per NIC), its latency kept."""
    return replace(model, inter=Level.from_bandwidth(model.inter.alpha_s * 1e6, mbit / 1000), sharded_inter=None,
                   flat=None)


def expected_step_s(mode: Mode, compute_s: float, model: Model, layout: Layout, grad_bytes: float,
                    chunk_bytes: float | None = None) -> float:
    """Seconds per step of ``mode``: the compute, plus the gradients' all-reduce every step (the inter-node hop
    at half the bytes per value in 16 bits), or, for DiLoCo, the node's own all-reduce every step and the
    model's bytes across nodes once every H steps."""
    if mode.inter_compression == "bf16":
        model = replace(model, inter=model.inter.per_byte_scaled(0.5),
                        sharded_inter=model.sharded_inter and model.sharded_inter.per_byte_scaled(0.5))
    if mode.algorithm != "diloco":
        return compute_s + predict(model, mode.algorithm, layout, grad_bytes, chunk_bytes)["total"]
    g = layout.node_sizes[0]
    inside = predict(model, "hierarchical", Layout.uniform(1, g), grad_bytes)["total"]  # inside the node only
    across = predict(model, "hierarchical", Layout.uniform(layout.nnodes, 1), grad_bytes)["total"]
    return compute_s + inside + across / mode.sync_every


@dataclass(frozen=True)
class Interval:
    """What the job measured per step between two choices (the slowest rank's): the step's wall time, its
    compute (data, forward, backward), the inter-node phase's seconds (every step; under DiLoCo its syncs and
    probes per step) and the part of them not hidden behind backward (``inter_exposed_s``)."""

    step_s: float
    compute_s: float
    inter_s: float
    inter_exposed_s: float

    @property
    def hidden_s(self) -> float:
        """The inter-node seconds that backward hid: how much of a link's time a step can absorb."""
        return max(0.0, self.inter_s - self.inter_exposed_s)


def measured_step_s(running: Mode, measured: Interval, candidates: list[Mode], model: Model, layout: Layout,
                    grad_bytes: float, hidden_s: float) -> dict[Mode, float]:
    """Seconds per step of each of ``candidates`` (DiLoCo's ``sync_every`` replaced by the interval the link
    carries), from what ``running`` measured and ``model`` (the link at its measured rate) prices.

    On a machine where the workers share cores, the cost model's serial sum of phases misprices a step: a
    link's wait is hidden where other processes compute. So the running mode's measured step is the base,
    and only what differs is priced: from an every-step mode, DiLoCo saves the inter-node wait the step
    showed (``inter_exposed_s``) and adds its sync once per H steps, another every-step mode adds the cost
    model's difference; from DiLoCo, an every-step mode drops the syncs and probes and adds its inter-node
    all-reduce less what backward hid of it when last measured (``hidden_s``)."""
    across = predict(model, "hierarchical", Layout.uniform(layout.nnodes, 1), grad_bytes)["total"]
    diloco = Mode("diloco", sync_every=diloco_sync_every(across, measured.compute_s))
    out: dict[Mode, float] = {}
    for mode in candidates:
        if mode.algorithm == "diloco":
            base = measured.step_s - (measured.inter_s if running.algorithm == "diloco" else measured.inter_exposed_s)
            out[diloco] = base + across / diloco.sync_every
        elif running.algorithm != "diloco":
            out[mode] = measured.step_s + (expected_step_s(mode, 0.0, model, layout, grad_bytes)
                                           - expected_step_s(running, 0.0, model, layout, grad_bytes))
        else:
            comm = expected_step_s(mode, 0.0, model, layout, grad_bytes)
            inside = expected_step_s(Mode("hierarchical"), 0.0, replace(model, inter=Level(0.0, 0.0)), layout,
                                     grad_bytes)  # the node's own phases: DiLoCo's step has them too
            out[mode] = measured.step_s - measured.inter_s + max(0.0, comm - inside - hidden_s)
    return out


def diloco_sync_every(sync_s: float, compute_s: float, choices: tuple[int, ...] = (8, 16, 32, 64, 128),
                      share: float = 0.1) -> int:
    """The smallest H of ``choices`` whose exchange (``sync_s`` once every H steps) costs at most ``share`` of
    the compute per step: fewer steps apart, closer to every-step training; the largest where none does."""
    if not choices or any(h < 1 for h in choices):
        raise ValueError(f"choices={choices} must be sync intervals >= 1")
    for h in sorted(choices):
        if sync_s / h <= share * compute_s:
            return h
    return max(choices)


class ModeChooser:
    """The most faithful mode that costs little more than the fastest, kept until the link says otherwise.

    ``preference`` lists the candidates' kinds most faithful first (every-step fp32 before 16 bits before
    DiLoCo): each keeps the replicas closer to every-step training than the next. DiLoCo's interval is not part
    of the kind: each choice prices DiLoCo at the interval the link carries then (:func:`diloco_sync_every`).
    A mode is acceptable when it is expected within ``slack`` (relative) of the fastest; the choice is the
    first acceptable one. Around that rule sits a margin both ways, so that a mode near the line does not
    flap: the current mode is left only once it is more than ``slack`` + ``margin`` off the fastest or a more
    faithful one is within ``slack`` - ``margin`` of it, at ``patience`` choices in a row."""

    def __init__(self, preference: list[Mode], current: Mode, slack: float = 0.15, margin: float = MODE_MARGIN,
                 patience: int = 2) -> None:
        kinds = [mode.kind for mode in preference]
        if current.kind not in kinds or len(set(kinds)) != len(kinds):
            raise ValueError(f"the current mode {current} must be one of the candidates, each kind named once")
        if not 0 <= margin <= slack or patience < 1:
            raise ValueError(f"margin={margin} must be in 0..slack={slack} and patience={patience} >= 1")
        self.kinds, self.current = kinds, current
        self.slack, self.margin, self.patience = slack, margin, patience
        self._wanted: tuple[str, str] | None = None
        self._times = 0

    def choose(self, expected: dict[Mode, float]) -> Mode:
        """The mode to run next, from each candidate's expected seconds per step (one mode of each kind)."""
        by_kind = {mode.kind: (mode, seconds) for mode, seconds in expected.items()}
        missing = [" ".join(kind) for kind in self.kinds if kind not in by_kind]
        if missing:
            raise ValueError(f"no expected step time for {', '.join(missing)}")
        wanted = self._wanted_now({kind: by_kind[kind][1] for kind in self.kinds})
        self._times = self._times + 1 if wanted == self._wanted else 1
        self._wanted = wanted
        kind = self.current.kind
        if wanted != kind and self._times >= self.patience:
            kind, self._wanted, self._times = wanted, None, 0
        self.current = by_kind[kind][0]  # DiLoCo at the interval priced now
        return self.current

    def reset(self, current: Mode) -> None:
        """The job now runs ``current`` (whatever chose it): choose on from there, with no switch pending."""
        self.current, self._wanted, self._times = current, None, 0

    def state_dict(self) -> dict:
        """Where the chooser stands (the current mode, a switch it is waiting to confirm): a resumed run goes on
        choosing as the straight one does."""
        return {"current": self.current.name, "sync_every": self.current.sync_every,
                "wanted": list(self._wanted) if self._wanted else None, "times": self._times}

    def load_state_dict(self, state: dict) -> None:
        self.current = Mode.parse(state["current"], state["sync_every"])
        self._wanted = tuple(state["wanted"]) if state["wanted"] else None
        self._times = int(state["times"])

    def _wanted_now(self, seconds: dict[tuple[str, str], float]) -> tuple[str, str]:
        fastest = min(seconds.values())
        current = self.current.kind
        for kind in self.kinds[:self.kinds.index(current)]:  # a more faithful mode, clearly affordable
            if seconds[kind] <= (1 + self.slack - self.margin) * fastest:
                return kind
        if seconds[current] <= (1 + self.slack + self.margin) * fastest:
            return current
        return next(kind for kind in self.kinds if seconds[kind] <= (1 + self.slack) * fastest)


class ModePlan:
    """Switches at given steps instead of measured ones: ``[[after_step, mode], ...]`` (``comm.adapt_plan``). For
    runs that must switch at known steps: an oracle that knows the link's schedule, tests of the switch itself."""

    def __init__(self, entries: list, key: str = "comm.adapt_plan") -> None:
        self.entries: list[tuple[int, Mode]] = []
        for entry in entries:
            if (not isinstance(entry, (list, tuple)) or len(entry) != 2 or isinstance(entry[0], bool)
                    or not isinstance(entry[0], int) or entry[0] < 0):
                raise ValueError(f"{key} entry {entry!r} must be [after_step, mode] with after_step a whole "
                                 "number >= 0")
            try:
                mode = Mode.parse(entry[1])
            except ValueError as exc:
                raise ValueError(f"{key} entry {list(entry)!r}: {exc}") from None
            self.entries.append((entry[0], mode))
        steps = [at for at, _ in self.entries]
        if steps != sorted(set(steps)):
            raise ValueError(f"{key}={[list(e) for e in entries]!r} must list its steps in increasing order, each once")

    def due(self, done: int) -> Mode | None:
        """The mode the plan asks for once ``done`` steps are done (None before its first entry)."""
        due = [mode for at, mode in self.entries if at <= done]
        return due[-1] if due else None
