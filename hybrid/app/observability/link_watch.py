"""``comm.adapt_every``: the inter-node link as the running job measures it, and the mode that would serve it best.

Every ``adapt_every`` steps each rank hands in what its counters measured since the last time: the bytes and
seconds of the inter-node phase and of the node's own phases, and its steps' seconds. They are all-reduced
(the bytes that crossed each node's link summed over its workers, the seconds the slowest rank's: it sets
the step's pace), so every rank reaches the same estimate and the same advice at the same step, which is what
a switch between modes will need. The estimate is a window's median (:class:`hybrid.core.adaptive.LinkEstimate`);
each mode is priced by the cost model at the measured rates (latency left out: the rates dominate at these
sizes; the inter-node phase's seconds are the time spent waiting on it, so where a pipeline overlaps it with
the node's own phases the rate reads high), and :class:`hybrid.core.adaptive.ModeChooser` advises the most
faithful mode within 15% of the fastest.

Logged: TensorBoard ``adaptive/link_mbit`` (the inter-node rate), ``adaptive/compute_s`` (a step's seconds less
its communication), ``adaptive/expected_s/<mode>`` and ``adaptive/advice`` (the advised mode's place in
:data:`PREFERENCE`) and ``adaptive/diloco_sync_every``; a status line when the advised mode changes;
metrics.json ``link_watch``: per estimate, its step, the interval's own rate, the estimate and the advice.
Under ``comm=adaptive`` (:mod:`hybrid.app.replicas.adaptive`) the advice is followed: the replica tells the watch
each switch (:meth:`LinkWatch.switched`), ``adaptive/mode`` logs the mode that runs, and while DiLoCo leaves the
link idle between its syncs the watch probes it (``probe``: a timed all-reduce among the node leaders).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from hybrid.app.observability.metrics import Metrics
from hybrid.core.adaptive import LinkEstimate, Mode, ModeChooser, diloco_sync_every, expected_step_s
from hybrid.core.comm import PhaseStats
from hybrid.core.costmodel import Level, Model, predict
from hybrid.core.topology import Layout

__all__ = ["PREFERENCE", "LinkWatch"]

# The candidates, most faithful to every-step training first; DiLoCo's interval follows the measured link.
PREFERENCE = (Mode("hierarchical"), Mode("sharded"), Mode("hierarchical", "bf16"), Mode("sharded", "bf16"),
              Mode("diloco"))
INTER = ("inter_allreduce",)
INTRA = ("intra_reduce", "intra_broadcast")


def _tag(mode: Mode) -> str:
    return mode.algorithm + ("_bf16" if mode.inter_compression == "bf16" else "")


class LinkWatch:
    """Collective at every ``every``-th step (:meth:`step`): every rank calls it after each step."""

    def __init__(self, every: int, layout: Layout, grad_bytes: int, current: Mode, metrics: Metrics,
                 nics_per_node: int = 1, candidates: tuple[Mode, ...] = PREFERENCE,
                 probe: Callable[[], tuple[float, float]] | None = None) -> None:
        if not layout.is_uniform:
            raise ValueError(f"comm.adapt_every prices modes for nodes of equal size; these have "
                             f"{list(layout.node_sizes)} workers")
        self.every, self.layout, self.grad_bytes, self.metrics = every, layout, grad_bytes, metrics
        self.nics, self.candidates, self.probe = nics_per_node, tuple(candidates), probe
        self.inter, self.intra = LinkEstimate(), LinkEstimate()
        # The estimate already waits for a second sample before it follows a change: one choice is enough here.
        self.chooser = ModeChooser(list(self.candidates), current, patience=1)
        self.running = current
        self.advice: Mode | None = None
        self.history: list[dict[str, Any]] = []
        # inter bytes, inter seconds, intra bytes, intra seconds, steps' seconds, steps: since the last estimate
        self._sums = [0.0] * 6

    @property
    def nics_used(self) -> int:
        """The NICs the running mode's inter-node traffic spreads over: the leader's one, or sharded's g groups."""
        return min(self.layout.node_sizes[0], self.nics) if self.running.algorithm == "sharded" else 1

    def step(self, done: int, phases: dict[str, PhaseStats], step_s: float) -> None:
        """Account step ``done``; at every ``every``-th, estimate and advise (collective)."""
        for i, names in ((0, INTER), (2, INTRA)):
            self._sums[i] += sum(phases[n].bytes for n in names if n in phases)
            self._sums[i + 1] += sum(phases[n].seconds for n in names if n in phases)
        self._sums[4] += step_s
        self._sums[5] += 1
        if done % self.every == 0:
            if self.probe is not None and self.running.algorithm == "diloco":
                nbytes, seconds = self.probe()  # the link between DiLoCo's syncs; its time counts as the step's
                self._sums[0] += nbytes
                self._sums[1] += seconds
                self._sums[4] += seconds
            self._estimate(done)

    def switched(self, mode: Mode) -> None:
        """The job now runs ``mode``: the link is measured anew under it (its traffic differs), and the advice
        starts from it."""
        self.running = self.advice = mode
        self.chooser.reset(mode)
        self.inter.forget()

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to choose as the straight one does: samples, sums, the chooser, the advice."""
        return {"inter": [list(self.inter.samples), self.inter.held],
                "intra": [list(self.intra.samples), self.intra.held], "sums": list(self._sums),
                "chooser": self.chooser.state_dict(), "running": [self.running.name, self.running.sync_every],
                "advice": [self.advice.name, self.advice.sync_every] if self.advice else None,
                "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for estimate, (samples, held) in ((self.inter, state["inter"]), (self.intra, state["intra"])):
            estimate.samples.extend(samples)
            estimate.held = held
        self._sums = [float(v) for v in state["sums"]]
        self.chooser.load_state_dict(state["chooser"])
        self.running = Mode.parse(*state["running"])
        self.advice = Mode.parse(*state["advice"]) if state["advice"] else None
        self.history = list(state["history"])

    def _estimate(self, done: int) -> None:
        sums = torch.tensor(self._sums, dtype=torch.float64)
        crossed = sums[:1].clone()
        dist.all_reduce(sums, op=dist.ReduceOp.MAX)  # the same figures on every rank
        dist.all_reduce(crossed)  # what the node's NIC carried: the leader's, or with sharded every worker's share
        inter_b = float(crossed) / self.layout.nnodes / self.nics_used  # per NIC: the cost model's inter level
        _, inter_s, intra_b, intra_s, step_s, steps = sums.tolist()
        self._sums = [0.0] * 6
        self.inter.add(inter_b, inter_s)
        self.intra.add(intra_b, intra_s)
        if self.inter.mbit is None:
            return  # too few bytes crossed nodes to time the link
        compute_s = max(0.0, (step_s - inter_s - intra_s) / steps)
        expected = self._price(compute_s)
        advice = self.chooser.choose(expected)
        kinds = [m.kind for m in self.candidates]
        values = {"adaptive/link_mbit": self.inter.mbit, "adaptive/compute_s": compute_s,
                  "adaptive/advice": float(kinds.index(advice.kind)),
                  "adaptive/mode": float(kinds.index(self.running.kind)) if self.running.kind in kinds else -1.0,
                  "adaptive/diloco_sync_every": float(diloco_sync_every(self._across(), compute_s)),
                  **{f"adaptive/expected_s/{_tag(m)}": s for m, s in expected.items()}}
        self.metrics.scalars(done, values)
        sample = inter_b * 8 / inter_s / 1e6 if inter_s > 0 else None  # this interval's own rate
        self.history.append({"step": done, "interval_mbit": sample and round(sample, 3),
                             "link_mbit": round(self.inter.mbit, 3), "advice": str(advice),
                             "mode": str(self.running)})
        if self.advice is None or advice.kind != self.advice.kind:  # DiLoCo's interval alone: TensorBoard only
            self.metrics.status(f"adaptive: inter-node link ~{self.inter.mbit:.0f} Mbit/s after step {done}; "
                                f"{advice} fits it best ({expected[advice]:.3f} s/step expected; "
                                + ", ".join(f"{m} {s:.3f}" for m, s in expected.items() if m != advice) + ")")
        self.advice = advice

    def _model(self) -> Model:
        inter = Level.from_bandwidth(0.0, self.inter.mbit / 1000)
        intra = Level.from_bandwidth(0.0, self.intra.mbit / 1000) if self.intra.mbit else Level(0.0, 0.0)
        return Model(intra=intra, inter=inter, nics_per_node=self.nics)

    def _across(self) -> float:
        """Seconds for the model's bytes to cross among the nodes once (DiLoCo's sync), at the measured rate."""
        return predict(self._model(), "hierarchical", Layout.uniform(self.layout.nnodes, 1), self.grad_bytes)["total"]

    def _price(self, compute_s: float) -> dict[Mode, float]:
        model = self._model()
        diloco = Mode("diloco", sync_every=diloco_sync_every(self._across(), compute_s))
        modes = [diloco if mode.algorithm == "diloco" else mode for mode in self.candidates]
        return {mode: expected_step_s(mode, compute_s, model, self.layout, self.grad_bytes) for mode in modes}
