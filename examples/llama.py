"""A Llama-style decoder: pre-RMSNorm blocks, causal multi-head attention with rotary position
embeddings, SwiGLU MLP, no biases. Every block matmul is an nn.Linear (attention `qkv` and
`proj`, MLP `gate`, `up` and `down`), which is what fp8ops.convert_to_fp8 replaces; the token
embedding `tok_emb` and the (untied) LM head `lm_head` sit outside `blocks` so that the demo's
filter_fn keeps them in high precision, as examples/gpt.py's GPT does."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 128
    n_layer: int = 2
    n_head: int = 4
    rope_base: float = 10000.0

    @property
    def ffn_hidden(self) -> int:
        """SwiGLU width: 8/3 d_model rounded up to a multiple of 256 (2048 -> 5632)."""
        return 256 * math.ceil(8 * self.d_model / 3 / 256)


def rotary_tables(seq_len: int, head_dim: int, base: float):
    """cos and sin of each position's rotation angles, (seq_len, head_dim / 2), float32."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    """Rotary embedding of x (B, H, T, head_dim): each pair (x[i], x[i + head_dim/2]) turned by
    its position's angle (the "rotate half" layout), in float32, back in x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.norm1, self.attn = nn.RMSNorm(cfg.d_model), Attention(cfg)
        self.norm2, self.mlp = nn.RMSNorm(cfg.d_model), SwiGLU(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        if cfg.d_model % cfg.n_head or (cfg.d_model // cfg.n_head) % 2:
            raise ValueError(f"d_model {cfg.d_model} must split into {cfg.n_head} heads of an "
                             "even size (rotary embeddings turn pairs of features)")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.seq_len, cfg.d_model // cfg.n_head, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # Linear and Embedding weights; the RMSNorm gains stay 1
                # the residual projections scaled down with depth, as GPT-2 (examples/gpt.py)
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(
                    ("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
