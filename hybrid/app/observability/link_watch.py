"""``comm.adapt_every``: the inter-node link as the running job measures it, and the mode that would serve it best.

Every ``adapt_every`` steps each rank hands in what it measured since the last time: the bytes and seconds of
the inter-node phase and of the node's own phases, its steps' seconds, their compute and the inter-node
seconds backward did not hide. They are all-reduced (the bytes that crossed each node's link summed over its
workers, the seconds the slowest rank's: it sets the step's pace), so every rank reaches the same estimate and
the same advice at the same step, which is what a switch between modes needs. The link's own seconds (and the
exposed ones) are each step's least among the ranks that crossed it: a collective's first arrival counts its
wait for the last one too (a peer's slow batch read a 1000 Mbit/s link as 37 Mbit/s), the last arrival's
seconds are the link's. The link's rate is a window's median (:class:`hybrid.core.adaptive.LinkEstimate`); no
advice is given while a sample far off it waits for a second opinion, nor in the interval after a switch (it
holds the switch itself). Each mode's step is priced from the running mode's measured step and what the cost
model says differs at the measured rate (:func:`hybrid.core.adaptive.measured_step_s`), and
:class:`hybrid.core.adaptive.ModeChooser` advises the most faithful mode expected within ``slack`` of the fastest
(``comm.adapt_slack``: a less faithful mode only where it is twice as fast, by default).

Logged: TensorBoard ``adaptive/link_mbit`` (the inter-node rate), ``adaptive/compute_s`` (a step's data, forward
and backward), ``adaptive/inter_exposed_s``, ``adaptive/expected_s/<mode>``, ``adaptive/advice`` and
``adaptive/mode`` (the advised and the running mode's place among the candidates) and
``adaptive/diloco_sync_every``; a status line when the advised mode changes; metrics.json ``link_watch``: per
estimate, its step, the interval's own rate, the estimate, the step's seconds, the advice and the running mode.
Under ``comm=adaptive`` (:mod:`hybrid.app.replicas.adaptive`) the advice is followed: the replica tells the watch
each switch (:meth:`LinkWatch.switched`), and while DiLoCo leaves the link idle between its syncs the watch
probes it (``probe``: a timed all-reduce among the node leaders).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from hybrid.app.observability.metrics import Metrics
from hybrid.core.adaptive import Interval, LinkEstimate, Mode, ModeChooser, measured_step_s
from hybrid.core.comm import PhaseStats
from hybrid.core.costmodel import Level, Model
from hybrid.core.timeline import StepTimes
from hybrid.core.topology import Layout

__all__ = ["PREFERENCE", "LinkWatch"]

# The candidates, most faithful to every-step training first; DiLoCo's interval follows the measured link.
PREFERENCE = (Mode("hierarchical"), Mode("sharded"), Mode("hierarchical", "bf16"), Mode("sharded", "bf16"),
              Mode("diloco"))
INTER = ("inter_allreduce",)
MIN_BYTES = 64 * 1024  # an interval's bytes per NIC below this time the latency more than the rate
INTRA = ("intra_reduce", "intra_broadcast")
# What each rank adds up between two estimates (all-reduced: inter bytes summed, the rest the slowest rank's;
# the inter-node and exposed seconds are kept per step apart, each step's least taken).
SUMS = ("inter_bytes", "inter_s", "intra_bytes", "intra_s", "step_s", "steps", "compute_s", "inter_exposed_s")


def _tag(mode: Mode) -> str:
    return mode.algorithm + ("_bf16" if mode.inter_compression == "bf16" else "")


class LinkWatch:
    """Collective at every ``every``-th step (:meth:`step`): every rank calls it after each step."""

    def __init__(self, every: int, layout: Layout, grad_bytes: int, current: Mode, metrics: Metrics,
                 nics_per_node: int = 1, candidates: tuple[Mode, ...] = PREFERENCE,
                 probe: Callable[[], tuple[float, float]] | None = None, slack: float = 1.0) -> None:
        if not layout.is_uniform:
            raise ValueError(f"comm.adapt_every prices modes for nodes of equal size; these have "
                             f"{list(layout.node_sizes)} workers")
        self.every, self.layout, self.grad_bytes, self.metrics = every, layout, grad_bytes, metrics
        self.nics, self.candidates, self.probe = nics_per_node, tuple(candidates), probe
        self.inter, self.intra = LinkEstimate(min_bytes=MIN_BYTES), LinkEstimate(min_bytes=MIN_BYTES)
        # The estimate already waits for a second sample before it follows a change: one choice is enough here.
        self.chooser = ModeChooser(list(self.candidates), current, slack=slack, patience=1)
        # DiLoCo's exchanges overlapped with its inner steps (comm.overlap): their counted seconds are the waits left
        # after the overlap, not the link's, so under DiLoCo the probe alone measures the link.
        self.diloco_overlaps = False
        self.running = current
        self.advice: Mode | None = None
        self.history: list[dict[str, Any]] = []
        self.hidden_s = 0.0  # the inter-node seconds per step backward hid, when an every-step mode last ran
        self._skip = False  # the interval after a switch holds the switch itself: not a measurement of the mode
        self._sums = [0.0] * len(SUMS)
        self._clear_steps()

    def _clear_steps(self) -> None:
        """Each step's inter-node seconds and its exposed ones, by step within the interval; inf where the rank
        crossed nothing (each step's least among the ranks is taken)."""
        self._inter_steps, self._exposed_steps = [math.inf] * self.every, [math.inf] * self.every

    @property
    def nics_used(self) -> int:
        """The NICs the running mode's inter-node traffic spreads over: the leader's one, or sharded's g groups."""
        return min(self.layout.node_sizes[0], self.nics) if self.running.algorithm == "sharded" else 1

    def step(self, done: int, phases: dict[str, PhaseStats], step_s: float, times: StepTimes | None = None) -> None:
        """Account step ``done`` (``times``: its compute and the phases' exposed seconds, where recorded); at
        every ``every``-th, estimate and advise (collective)."""
        sums = self._sums
        hidden = self.diloco_overlaps and self.running.algorithm == "diloco"
        crossed = sum(phases[n].bytes for n in INTER if n in phases) if not hidden else 0
        sums[0] += crossed
        at = (done - 1) % self.every
        exposed = sum(times.exposed.get(n, 0.0) for n in INTER) if times is not None else 0.0
        self._inter_steps[at] = sum(phases[n].seconds for n in INTER if n in phases) if crossed else math.inf
        self._exposed_steps[at] = exposed if crossed else math.inf
        sums[2] += sum(phases[n].bytes for n in INTRA if n in phases)
        sums[3] += sum(phases[n].seconds for n in INTRA if n in phases)
        sums[4] += step_s
        sums[5] += 1
        if times is not None:
            sums[6] += times.compute
        if done % self.every == 0:
            if self.probe is not None and self.running.algorithm == "diloco":
                nbytes, seconds = self.probe()  # the link between DiLoCo's syncs; its time counts as the step's
                sums[0] += nbytes
                sums[1] += seconds
                sums[4] += seconds
            self._estimate(done)

    def switched(self, mode: Mode) -> None:
        """The job now runs ``mode``: the link is measured anew under it (its traffic differs), and the advice
        starts from it."""
        self.running = self.advice = mode
        self.chooser.reset(mode)
        self.inter.forget()
        self._skip = True

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to choose as the straight one does: samples, sums, the chooser, the advice."""
        return {"inter": [list(self.inter.samples), self.inter.held],
                "intra": [list(self.intra.samples), self.intra.held], "sums": list(self._sums),
                "inter_steps": list(self._inter_steps), "exposed_steps": list(self._exposed_steps),
                "chooser": self.chooser.state_dict(), "running": [self.running.name, self.running.sync_every],
                "advice": [self.advice.name, self.advice.sync_every] if self.advice else None,
                "history": list(self.history), "hidden_s": self.hidden_s, "skip": self._skip}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for estimate, (samples, held) in ((self.inter, state["inter"]), (self.intra, state["intra"])):
            estimate.samples.extend(samples)
            estimate.held = held
        self._sums = [float(v) for v in state["sums"]]
        steps = state.get("inter_steps")  # absent from an older hybrid's: its interval is not measured
        self._clear_steps()
        if steps is not None:
            self._inter_steps, self._exposed_steps = [float(v) for v in steps], [float(v) for v in state["exposed_steps"]]
        self.chooser.load_state_dict(state["chooser"])
        self.running = Mode.parse(*state["running"])
        self.advice = Mode.parse(*state["advice"]) if state["advice"] else None
        self.history = list(state["history"])
        self.hidden_s, self._skip = float(state["hidden_s"]), bool(state["skip"]) or steps is None

    def _estimate(self, done: int) -> None:
        # One MAX for the slowest rank's sums and, negated, each step's least inter-node and exposed seconds.
        both = torch.tensor(self._sums + [-s for s in self._inter_steps + self._exposed_steps], dtype=torch.float64)
        crossed = both[:1].clone()
        dist.all_reduce(both, op=dist.ReduceOp.MAX)  # the same figures on every rank
        dist.all_reduce(crossed)  # what the node's NIC carried: the leader's, or with sharded every worker's share
        sums, least = both[:len(SUMS)], -both[len(SUMS):]
        least[~torch.isfinite(least)] = 0.0  # steps that crossed nothing (DiLoCo's inner steps)
        sums[1] += least[:self.every].sum()  # beside a probe's seconds (the slowest leader's)
        sums[7] += least[self.every:].sum()
        self._sums = [0.0] * len(SUMS)
        self._clear_steps()
        inter_b = float(crossed) / self.layout.nnodes / self.nics_used  # per NIC: the cost model's inter level
        _, inter_s, intra_b, intra_s, step_s, steps, compute_s, exposed_s = sums.tolist()
        measured = Interval(step_s / steps, compute_s / steps, inter_s / steps, exposed_s / steps)
        sample = inter_b * 8 / inter_s / 1e6 if inter_b >= self.inter.min_bytes and inter_s > 0 else None
        entry = {"step": done, "interval_mbit": sample and round(sample, 3), "link_mbit": None,
                 "step_s": round(measured.step_s, 4), "advice": None, "mode": str(self.running)}
        self.history.append(entry)
        if self._skip:  # the switch's own interval (DDP rebuilt, buckets settled): not a measurement of the mode
            self._skip = False
            return
        self.inter.add(inter_b, inter_s)
        self.intra.add(intra_b, intra_s)
        entry["link_mbit"] = self.inter.mbit and round(self.inter.mbit, 3)
        if self.running.algorithm != "diloco":
            self.hidden_s = measured.hidden_s
        if len(self.inter.samples) < 2 or self.inter.held is not None:
            return  # too few samples to trust, or the link may have changed: the next interval will say
        entry["advice"] = str(self._advise(done, measured))

    def _advise(self, done: int, measured: Interval) -> Mode:
        expected = measured_step_s(self.running, measured, list(self.candidates), self._model(), self.layout,
                                   self.grad_bytes, self.hidden_s)
        advice = self.chooser.choose(expected)
        kinds = [m.kind for m in self.candidates]
        values = {"adaptive/link_mbit": self.inter.mbit, "adaptive/compute_s": measured.compute_s,
                  "adaptive/inter_exposed_s": measured.inter_exposed_s,
                  "adaptive/advice": float(kinds.index(advice.kind)),
                  "adaptive/mode": float(kinds.index(self.running.kind)) if self.running.kind in kinds else -1.0,
                  "adaptive/diloco_sync_every": float(next(m.sync_every for m in expected if m.algorithm == "diloco")),
                  **{f"adaptive/expected_s/{_tag(m)}": s for m, s in expected.items()}}
        self.metrics.scalars(done, values)
        if self.advice is None or advice.kind != self.advice.kind:  # DiLoCo's interval alone: TensorBoard only
            self.metrics.status(f"adaptive: inter-node link ~{self.inter.mbit:.0f} Mbit/s after step {done}; "
                                f"{advice} fits it best ({expected[advice]:.3f} s/step expected; "
                                + ", ".join(f"{m} {s:.3f}" for m, s in expected.items() if m != advice) + ")")
        self.advice = advice
        return advice

    def _model(self) -> Model:
        inter = Level.from_bandwidth(0.0, self.inter.mbit / 1000)
        intra = Level.from_bandwidth(0.0, self.intra.mbit / 1000) if self.intra.mbit else Level(0.0, 0.0)
        return Model(intra=intra, inter=inter, nics_per_node=self.nics)
