"""What per-rank accounting and the timeline add to a step, measured in one process without the noise of a job.

The same training step (MLP 512 x 6, batch 32, SGD, one thread) in blocks of 50, alternating (40 rounds,
rotating order: this VM's speed drifts by 20% over minutes): plain; with the trainer's accounting as it runs
with the timeline off (StepRecorder spans for data, forward, backward with its gradient hooks, optimizer; 3
phases per bucket for 4 buckets through PhaseCounters; end_step; the row kept for the log step's exchange); and
the same with the timeline recording every step. Prints the median step time of each and the differences in
microseconds.

    python experiments/timeline_cost.py [ROUNDS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from hybrid.core.comm import PHASES, PhaseCounters
from hybrid.core.timeline import SEGMENTS, StepRecorder, bucket_scope

STEPS = 50


def block(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, mode: str) -> float:
    rec = StepRecorder(PHASES) if mode != "plain" else None
    counters = PhaseCounters(rec)
    rows: list[list[float]] = []
    if rec is not None:
        rec.watch_gradients(model)
        rec.recording = mode == "timeline"
    start = time.perf_counter()
    for step in range(STEPS):
        if rec is None:
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            continue
        rec.step = step
        with rec.span("data"):
            batch = x
        with rec.span("forward"):
            loss = model(batch).square().mean()
        rec.backward(loss)
        now = time.perf_counter()
        for bucket in range(4):  # what a communicator's phases hand the recorder for 4 buckets
            with bucket_scope(bucket, 2**20):
                for phase in ("intra_reduce", "inter_allreduce", "intra_broadcast"):
                    counters.add(phase, 1e-4, 2**20, now)
        with rec.span("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=False)
        times = rec.end_step()
        rows.append([0, 0, step, 0.0, *(times.segments[s] for s in SEGMENTS), *times.phases.values(),
                     *times.exposed.values()])
    elapsed = (time.perf_counter() - start) / STEPS
    if rec is not None:
        rec.take_spans()
        rec.close()
    return elapsed


def main() -> None:
    blocks = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    torch.manual_seed(0)
    torch.set_num_threads(1)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(32, 512)
    modes = ("plain", "accounting", "timeline")
    results: dict[str, list[float]] = {m: [] for m in modes}
    for i in range(blocks + 1):
        for m in modes[i % 3:] + modes[:i % 3]:
            t = block(model, opt, x, m)
            if i:  # the first round warms up
                results[m].append(t)
    plain = statistics.median(results["plain"])
    # Paired by round (the three ran back to back), so the drift cancels.
    for m in modes[1:]:
        diffs = [(a - b) * 1e6 for a, b in zip(results[m], results["plain"])]
        q1, med, q3 = statistics.quantiles(diffs, n=4)
        print(f"{m} - plain, paired by round: median {med:+.1f} us/step (quartiles {q1:+.1f} .. {q3:+.1f})")
    for m in modes:
        med = statistics.median(results[m])
        print(f"{m:>10}: {med * 1e6:8.1f} us/step  (+{(med - plain) * 1e6:6.1f} us, {med / plain - 1:+.2%} of plain)")


def primitives(n: int = 20000) -> None:
    """The pieces the accounting adds, each timed alone (the end-to-end difference drowns in this VM's noise)."""
    rec = StepRecorder(PHASES)
    counters = PhaseCounters(rec)
    t = time.perf_counter()
    for _ in range(n):
        with rec.span("data"):
            pass
    span = (time.perf_counter() - t) / n
    t = time.perf_counter()
    for _ in range(n):
        with bucket_scope(1, 10):
            counters.add("intra_reduce", 1e-4, 10, 1.0)
    add = (time.perf_counter() - t) / n
    t = time.perf_counter()
    for _ in range(n):
        rec.end_step()
    end = (time.perf_counter() - t) / n
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(16, 16), torch.nn.ReLU()]
    tiny, x = torch.nn.Sequential(*layers), torch.randn(4, 16)

    def backward(k: int = 200) -> float:
        t0 = time.perf_counter()
        for _ in range(k):
            tiny(x).sum().backward()
        return (time.perf_counter() - t0) / k

    diffs = []
    for _ in range(60):
        a = backward()
        rec.watch_gradients(tiny)
        b = backward()
        rec.close()
        diffs.append((b - a) / 12)
    hook = statistics.median(diffs)
    print(f"pieces: span {span * 1e6:.1f} us, phase record {add * 1e6:.1f} us, end_step {end * 1e6:.1f} us, "
          f"gradient hook {hook * 1e6:.2f} us per parameter")
    print(f"a step of 4 loop spans, 4 buckets x 3 phases, 12 parameters: "
          f"{(4 * span + 12 * add + end + 12 * hook) * 1e6:.0f} us")


if __name__ == "__main__":
    main()
    primitives()
