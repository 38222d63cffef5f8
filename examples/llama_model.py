"""A small Llama-style decoder and a character corpus that every machine has.

The model has the parts that matter for a realistic step: token embedding,
pre-norm blocks with RMSNorm, causal self-attention with rotary position
embeddings, a SwiGLU feed-forward, a final norm and an untied output head.
The corpus is the Python standard library's own ``.py`` sources, read as
bytes (a 256-symbol vocabulary), so nothing is downloaded.
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    """Model shape.  The defaults give about 2 M parameters."""

    vocab_size: int = 256
    dim: int = 192
    n_layers: int = 4
    n_heads: int = 6
    hidden_dim: int = 512
    max_seq_len: int = 256
    rope_base: float = 10000.0
    norm_eps: float = 1e-5


class RMSNorm(nn.Module):
    """Scales each vector by the reciprocal of its root mean square."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ms = x.float().pow(2).mean(dim=-1, keepdim=True)
        return (x.float() * torch.rsqrt(ms + self.eps)).type_as(x) * self.weight


def rotary_tables(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position x frequency, each (seq_len, head_dim // 2)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates consecutive pairs of x (batch, heads, seq, head_dim)."""
    seq = x.shape[-2]
    c, s = cos[:seq], sin[:seq]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1)
    return out.flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    """Decoder-only transformer; forward returns logits (batch, seq, vocab)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.n_heads or (cfg.dim // cfg.n_heads) % 2:
            raise ValueError("dim must split into heads of even size")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.max_seq_len, cfg.dim // cfg.n_heads, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, 0.02) weights; output projections scaled by depth."""
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            std = 0.02
            if name.endswith(("wo.weight", "w2.weight")):
                std /= math.sqrt(2 * self.cfg.n_layers)
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        for blk in self.blocks:
            x = blk(x, self.rope_cos, self.rope_sin)
        return self.output(self.norm(x))


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def stdlib_corpus(max_bytes: int = 4 << 20) -> torch.Tensor:
    """The standard library's .py files, in sorted path order, as bytes.

    Returns:
        A uint8 tensor of at most ``max_bytes`` bytes (the same on every
        machine with the same Python).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 4096:
        raise RuntimeError(f"found only {total} bytes of Python source under {root}")
    blob = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


class CorpusWindows(torch.utils.data.Dataset):
    """The corpus cut into consecutive windows of ``seq_len + 1`` bytes:
    sample ``i`` is window ``i``'s inputs and next-byte targets.  ``samples``
    (0: every whole window) keeps the first that many."""

    def __init__(self, corpus: torch.Tensor, seq_len: int, samples: int = 0) -> None:
        whole = (corpus.numel() - 1) // seq_len
        if samples < 0 or samples > whole:
            raise ValueError(f"{samples} samples asked for; the corpus has {whole} windows "
                             f"of {seq_len} + 1 bytes")
        self.corpus, self.seq_len, self.n = corpus, seq_len, samples or whole

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(f"sample {i} of {self.n}")
        w = self.corpus[i * self.seq_len:(i + 1) * self.seq_len + 1].long()
        return w[:-1], w[1:]


def batch_at(corpus: torch.Tensor, step: int, stream: int, batch_size: int,
             seq_len: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch for (step, stream): inputs and next-byte targets."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + stream * 7919 + step)
    starts = torch.randint(0, corpus.numel() - seq_len - 1, (batch_size,), generator=g)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    window = corpus[idx].long()
    return window[:, :-1], window[:, 1:]
