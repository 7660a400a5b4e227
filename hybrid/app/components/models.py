"""The built-in models (targets of ``conf/model/*.yaml``), whose gradient size is a config knob (width x depth).

Parameter bytes (= gradient bytes per step) are roughly: MLP depth * width^2,
CNN channels^2 * 9 * depth + head, transformer 12 * depth * width^2 +
vocab * width. ``width=1024, depth=6`` MLP is ~25 MB of fp32 gradients;
``width=4096, depth=6`` ~400 MB.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid.app.targets import require_int

__all__ = ["CNN", "MLP", "HFCausalLM", "Transformer", "gpt2", "param_bytes"]

def _check_sizes(**sizes: int) -> None:
    """One line naming the config key (``model.width``) of a size that is not a positive integer."""
    for key, value in sizes.items():
        require_int(f"model.{key}", value, 1)
    if "heads" in sizes and sizes["width"] % sizes["heads"]:
        raise ValueError(f"model.width={sizes['width']} must be divisible by model.heads={sizes['heads']}")


class MLP(nn.Module):
    def __init__(self, in_features: int, width: int, depth: int, classes: int) -> None:
        _check_sizes(in_features=in_features, width=width, depth=depth, classes=classes)
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(in_features, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """Conv blocks (3x3 conv, ReLU; every second block halves the resolution) and a linear head."""

    def __init__(self, in_channels: int, channels: int, depth: int, width: int, classes: int) -> None:
        _check_sizes(in_channels=in_channels, channels=channels, depth=depth, width=width, classes=classes)
        super().__init__()
        blocks: list[nn.Module] = []
        c_in = in_channels
        for i in range(depth):
            blocks += [nn.Conv2d(c_in, channels, 3, padding=1), nn.ReLU()]
            if i % 2 == 1:
                blocks.append(nn.MaxPool2d(2))
            c_in = channels
        self.features = nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Sequential(nn.Linear(channels, width), nn.ReLU(), nn.Linear(width, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class Transformer(nn.Module):
    """A decoder-only language model (pre-norm blocks, causal mask, learned positions)."""

    def __init__(self, vocab_size: int, seq_len: int, width: int, depth: int, heads: int) -> None:
        _check_sizes(vocab_size=vocab_size, seq_len=seq_len, width=width, depth=depth, heads=heads)
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.pos = nn.Parameter(torch.zeros(1, seq_len, width))
        layer = nn.TransformerEncoderLayer(
            width, heads, dim_feedforward=4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size)
        mask = nn.Transformer.generate_square_subsequent_mask(seq_len)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:, :length]
        h = self.blocks(h, mask=self.mask[:length, :length], is_causal=True)
        return self.head(self.norm(h))


class HFCausalLM(nn.Module):
    """A Hugging Face causal language model seen as ``tokens -> logits``, like :class:`Transformer`.

    The loop, DDP and the checkpoints then treat it as any of our models; its
    own output object (with caches and optional loss) stays inside."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits


def gpt2(vocab_size: int, seq_len: int, width: int, depth: int, heads: int) -> HFCausalLM:
    """Hugging Face ``GPT2LMHeadModel``, randomly initialised from a ``GPT2Config`` (nothing is downloaded);
    its input and output embeddings are tied, as in GPT-2. Dropout is off, as in our other models, so runs
    differ only by how gradients travel."""
    _check_sizes(vocab_size=vocab_size, seq_len=seq_len, width=width, depth=depth, heads=heads)
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as exc:
        raise ValueError("model=gpt2 needs Hugging Face transformers: pip install -e '.[hf]'") from exc
    config = GPT2Config(vocab_size=vocab_size, n_positions=seq_len, n_embd=width, n_layer=depth, n_head=heads,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
    return HFCausalLM(GPT2LMHeadModel(config))


def param_bytes(model: nn.Module) -> int:
    """Bytes of trainable parameters, i.e. of the gradients all-reduced per step."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
