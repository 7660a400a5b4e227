"""Compress only the slow hop: the inter-node all-reduce travels in 16 bits, with error feedback.

The intra-node phases (NVLink, or loopback here) stay full precision; only the
leaders' (``hierarchical``) or cross groups' (``sharded``) all-reduce sends
bf16 or fp16, halving the bytes on the NIC.

Why error feedback: rounding a gradient to 16 bits drops its low bits, and
the same coordinates lose the same small amounts step after step, so a plain
cast biases training. Each sender keeps what rounding dropped (the residual)
and adds it to the next step's value before rounding, so over many steps the
sum of what was sent equals the sum of what should have been sent, up to one
rounding (1-bit SGD, Seide et al. 2014; EF-SGD, Karimireddy et al. 2019).
The cost is one full-precision residual per element a rank sends across
nodes: the whole gradient on a hierarchical leader, 1/g of it per sharded
worker.

A guard (:meth:`InterCompressor.guard`): every K uses of the first slice
this rank compresses (once a step, for a DDP bucket), that slice is also
all-reduced in full precision, and the relative error of the 16-bit result
is kept; above a bound (a gradient that overflows fp16's range, or one so
small that it vanishes in it) the hop goes back to full precision for good.
Every member of the all-reduce sees the same two results, so all of them
fall back at the same step.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

__all__ = ["INTER_COMPRESSIONS", "InterCompressor"]

INTER_COMPRESSIONS = ("none", "bf16", "fp16")
_WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_COMPRESSIBLE = (torch.float32, torch.float64)


class InterCompressor:
    """Rounds values to the wire dtype and keeps, per key, what the rounding dropped."""

    def __init__(self, kind: str = "none") -> None:
        if kind not in INTER_COMPRESSIONS:
            raise ValueError(f"comm.inter_compression={kind!r} is not one of {', '.join(INTER_COMPRESSIONS)}")
        self.kind = kind
        self.wire_dtype = _WIRE_DTYPES.get(kind)
        self._residuals: dict[Hashable, torch.Tensor] = {}
        self.check_every, self.max_error = 0, float("inf")  # the guard: off
        self.checks: list[float] = []  # each check's relative error
        self.fell_back = False  # the guard found the error above max_error: full precision from then on
        self._checked_key: Hashable | None = None  # the slice the guard checks: the first one compressed
        self._uses = 0  # how often that slice was compressed

    def guard(self, check_every: int, max_error: float) -> None:
        """Check one slice in full precision every ``check_every`` uses of it (0: never) and fall back to full
        precision where the relative error exceeds ``max_error``."""
        if check_every < 0 or not max_error > 0:
            raise ValueError(f"check_every={check_every} must be >= 0 and max_error={max_error} > 0")
        self.check_every, self.max_error = check_every, max_error

    def applies_to(self, tensor: torch.Tensor) -> bool:
        """Only full-precision tensors are compressed (a bf16/fp16 gradient already travels in 16 bits), and
        nothing once the guard has fallen back."""
        return self.wire_dtype is not None and tensor.dtype in _COMPRESSIBLE and not self.fell_back

    def due(self, key: Hashable) -> bool:
        """Whether the guard checks this use of ``key`` (call once per compressed all-reduce, before
        :meth:`compress_`): the same answer on every member of the all-reduce, which sees the same keys."""
        if self._checked_key is None:
            self._checked_key = key
        if key != self._checked_key:
            return False
        self._uses += 1
        return self.check_every > 0 and self._uses % self.check_every == 0

    def judge(self, compressed: torch.Tensor, full: torch.Tensor) -> float:
        """Record the relative error of the 16-bit all-reduce's result against the full-precision one (the same
        slice, the same step) and fall back where it exceeds ``max_error``; returns it."""
        scale = float(full.double().norm())
        error = float((compressed.double() - full.double()).norm()) / scale if scale > 0 else 0.0
        error = error if error == error else float("inf")  # NaN (an inf on the wire): as bad as it gets
        self.checks.append(error)
        if error > self.max_error:
            self.fell_back = True
        return error

    def compress_(self, value: torch.Tensor, key: Hashable) -> torch.Tensor:
        """Add ``key``'s residual to ``value`` (in place), round it to the wire dtype, keep the new residual.

        ``key`` names the same slice of the gradient from step to step (the
        DDP bucket, its size and the pipeline piece); a key seen with another
        shape starts over from a zero residual. DDP rebuilds its buckets once,
        after its first synchronised backward; the trainer has it do so before
        the first step (:func:`hybrid.core.comm.settle_buckets`), so the keys are
        stable from then on. (Without that, a rebuilt bucket of the same index
        and size would inherit the old residual once, a misplaced correction
        of at most half a 16-bit unit per element.)
        """
        residual = self._residuals.get(key)
        if residual is None or residual.shape != value.shape or residual.dtype != value.dtype \
                or residual.device != value.device:
            residual = self._residuals[key] = torch.zeros_like(value)
        else:
            value.add_(residual)
        wire = value.to(self.wire_dtype)
        residual.copy_(value).sub_(wire)
        # A value beyond fp16's range rounds to inf: the step sees it (non-finite gradients stop or skip
        # the step), but the residual must not carry the inf or NaN into every later step.
        torch.nan_to_num_(residual, nan=0.0, posinf=0.0, neginf=0.0)
        return wire

    def state_dict(self) -> dict[str, Any]:
        """The residuals, copied to the CPU, and the guard's place (what a checkpoint keeps so a resumed run
        continues exactly)."""
        return {"kind": self.kind,
                "residuals": {key: r.detach().to("cpu", copy=True) for key, r in self._residuals.items()},
                "guard": {"key": self._checked_key, "uses": self._uses, "fell_back": self.fell_back,
                          "checks": list(self.checks)}}

    def load_state_dict(self, state: dict[str, Any], device: torch.device | str = "cpu") -> None:
        """Take over :meth:`state_dict`'s residuals onto ``device``; they must come from the same ``kind``."""
        if state.get("kind") != self.kind:
            raise ValueError(f"error-feedback residuals of inter_compression={state.get('kind')!r} cannot "
                             f"continue inter_compression={self.kind!r}")
        self._residuals = {key: r.to(device) for key, r in state["residuals"].items()}
        guard = state.get("guard")  # absent: saved before the guard existed
        if guard is not None:
            self._checked_key, self._uses = guard["key"], int(guard["uses"])
            self.fell_back, self.checks = bool(guard["fell_back"]), list(guard["checks"])

    def residual_bytes(self) -> int:
        """Memory the residuals hold (what error feedback costs this rank)."""
        return sum(r.nbytes for r in self._residuals.values())
