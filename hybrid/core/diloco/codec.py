"""How DiLoCo's pseudo-gradients travel between nodes: fp32, 16 bits, or 8 bits with a scale per block.

A pseudo-gradient crosses the slow link once per sync, so its bytes are the
whole cost of DiLoCo's inter-node traffic. Streaming DiLoCo (arXiv
2501.18512) sends its outer gradients in as few as 4 bits with no loss it
could measure; here ``fp8`` is float8 e4m3 with one fp32 scale per block of
:data:`BLOCK` values (the block's largest magnitude maps to e4m3's largest
finite value, 448), about 1.03 bytes per value against fp32's 4.

Low-precision values are not summed on the wire (gloo has no fp8 sum, and a
16-bit running sum would round at every hop): each node's encoded part is
all-gathered, every rank decodes all of them and sums them in node order in
fp32, so every rank gets the same bits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["BLOCK", "CODECS", "EncodedGather", "average_encoded", "decode", "encode", "wire_bytes"]

CODECS = ("none", "bf16", "fp16", "fp8")
BLOCK = 128
_FP8 = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(_FP8).max)
_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def encode(values: torch.Tensor, codec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, scales) of a 1-D fp32 tensor: fp8 e4m3 as bytes with a scale per block; 16 bits with no scale."""
    if codec in _HALF:
        return values.to(_HALF[codec]), torch.ones(0, device=values.device)
    if codec != "fp8":
        raise ValueError(f"codec={codec!r} is not one of {', '.join(c for c in CODECS if c != 'none')}")
    blocks = -(-values.numel() // BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=values.device)
    padded[:values.numel()] = values
    padded = padded.view(blocks, BLOCK)
    scales = padded.abs().amax(dim=1).div_(_FP8_MAX)
    scales[scales == 0] = 1.0  # an all-zero block: any scale encodes it exactly
    payload = (padded / scales[:, None]).to(_FP8).view(torch.uint8).reshape(-1)
    return payload, scales


def decode(payload: torch.Tensor, scales: torch.Tensor, numel: int, codec: str) -> torch.Tensor:
    """The fp32 values :func:`encode` was given, as rounded by ``codec``."""
    if codec in _HALF:
        return payload.to(torch.float32)
    blocks = payload.view(_FP8).to(torch.float32).view(-1, BLOCK) * scales[:, None]
    return blocks.reshape(-1)[:numel]


class EncodedGather:
    """An all-gather of every rank's encoded part, started (``async_op``); :meth:`mean_into` waits for it and
    writes the mean of the decoded parts, summed in fp32 in rank order (the same bits on every rank)."""

    def __init__(self, values: torch.Tensor, codec: str, group: dist.ProcessGroup, members: int) -> None:
        payload, scales = encode(values, codec)
        self.codec, self.members, self.numel = codec, members, values.numel()
        self.payloads = [torch.empty_like(payload) for _ in range(members)]
        self.scales = [torch.empty_like(scales) for _ in range(members)]
        self.works = [dist.all_gather(self.payloads, payload, group=group, async_op=True)]
        if scales.numel():
            self.works.append(dist.all_gather(self.scales, scales, group=group, async_op=True))

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []

    def mean_into(self, values: torch.Tensor) -> None:
        self.wait()
        total = torch.zeros_like(values)
        for part, scale in zip(self.payloads, self.scales):
            total += decode(part, scale, self.numel, self.codec)
        values.copy_(total.div_(self.members))


def average_encoded(values: torch.Tensor, codec: str, group: dist.ProcessGroup, members: int) -> None:
    """Replace ``values`` (1-D fp32) by the mean over ``group``'s ``members`` ranks of their ``codec``-rounded
    values: each rank's encoded part all-gathered, decoded and summed in rank order, the same bits everywhere."""
    EncodedGather(values, codec, group, members).mean_into(values)


def wire_bytes(numel: int, codec: str) -> int:
    """Bytes one rank's part of ``numel`` values takes on the wire with ``codec``."""
    if codec == "fp8":
        return numel + 4 * -(-numel // BLOCK)
    return numel * (2 if codec in _HALF else 4)
