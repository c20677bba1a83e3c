"""The demo's built-in models and their seeded, in-process data.

* `TinyLM`: a causal transformer language model (token + position embeddings,
  pre-LayerNorm blocks with explicit softmax attention and a GELU MLP). Its data is a
  seeded sparse Markov chain over the vocabulary: every token has 4 likely successors,
  so the loss can fall from ln(vocab) towards ln(4).
* `ConvNet`: a small conv net with BatchNorm. Its data is 10 classes of
  seeded random low-frequency images plus noise.

Both are also what ``benchmarks/run.py`` measures; ``lm_config`` scales the LM.
"""
import math
from dataclasses import dataclass
from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LMConfig:
    vocab: int = 256
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    seq_len: int = 64
    batch: int = 16


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal softmax attention, then a GELU MLP."""

    def __init__(self, d_model: int, n_heads: int, seq_len: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.fc2 = nn.Linear(4 * d_model, d_model)
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
        self.register_buffer("future", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (b, heads, t, head_dim)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_heads)
        attn = scores.masked_fill(self.future[:t, :t], float("-inf")).softmax(-1)
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    """Causal transformer LM; ``forward(tokens)`` returns logits of shape (batch, seq, vocab)."""

    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.Sequential(*(Block(cfg.d_model, cfg.n_heads, cfg.seq_len) for _ in range(cfg.n_layers)))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.head(self.ln_f(self.blocks(self.tok(tokens) + self.pos(pos))))


class ConvNet(nn.Module):
    """Three conv + BatchNorm + ReLU stages, global average pooling, a linear classifier."""

    def __init__(self, width: int = 32, classes: int = 10):
        super().__init__()
        layers, c_in = [], 3
        for c_out, stride in ((width, 1), (2 * width, 2), (4 * width, 2)):
            layers += [nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(c_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).mean((2, 3)))


def lm_batches(cfg: LMConfig, n: int, seed: int = 0) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (input, target) token batches from a seeded sparse Markov chain."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(cfg.vocab, (cfg.vocab, 4), generator=g)
    out = []
    for _ in range(n):
        tokens = torch.empty(cfg.batch, cfg.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(cfg.vocab, (cfg.batch,), generator=g)
        for t in range(cfg.seq_len):
            choice = torch.randint(4, (cfg.batch,), generator=g)
            tokens[:, t + 1] = successors[tokens[:, t], choice]
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def image_batches(n: int, batch: int = 32, size: int = 32, classes: int = 10, seed: int = 0):
    """``n`` (images, labels) batches: a seeded low-frequency template per class plus noise."""
    g = torch.Generator().manual_seed(seed)
    templates = F.interpolate(torch.randn(classes, 3, 4, 4, generator=g), size=size, mode="bilinear", align_corners=False)
    out = []
    for _ in range(n):
        y = torch.randint(classes, (batch,), generator=g)
        out.append((templates[y] + torch.randn(batch, 3, size, size, generator=g), y))
    return out


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())
