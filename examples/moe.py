"""The mixture-of-experts MLP of the demo's --moe variant: a top-2 router over E experts, each a
GELU MLP (up [4 d_model, d_model], down [d_model, 4 d_model]), as in Mixtral without the gating.

The experts live in one module, `Experts`, laid out as transformers keeps a MoE layer's experts:
3-D parameters `up_proj` [E, 4 d_model, d_model] and `down_proj` [E, d_model, 4 d_model] (stored
[E, out, in]: `is_transposed` False), `num_experts`, `has_gate` False with `act_fn`, no biases,
and a forward(hidden_states [T, d], top_k_index [T, k], top_k_weights [T, k]). That layout is
what fp8ops.convert_to_fp8 recognizes: it gives the module a forward that runs both projections
as FP8 grouped GEMMs (fp8ops.grouped_linear), the parameters unchanged. The module's own forward,
the high-precision baseline's, loops over the experts in the parameters' dtype. The router is an
nn.Linear named `router` (the demo's filter_fn keeps it in high precision: its 4 outputs are the
routing decision)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Experts(nn.Module):
    is_transposed = False  # parameters stored [E, out, in]
    has_gate = False  # up_proj, then act_fn (no gate_up_proj)
    has_bias = False

    def __init__(self, num_experts: int, d_model: int, hidden: int, n_layer: int):
        super().__init__()
        self.num_experts = num_experts
        self.act_fn = F.gelu
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden, d_model))
        self.down_proj = nn.Parameter(torch.empty(num_experts, d_model, hidden))
        # GPT-2's init (examples/gpt.py): std 0.02, the residual projection scaled down
        nn.init.normal_(self.up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        """Each expert on the tokens routed to it, weighted, summed per token (a loop)."""
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            if token.numel() == 0:
                continue
            h = self.act_fn(hidden_states[token] @ self.up_proj[e].t())
            y = (h @ self.down_proj[e].t()) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


class MoEMLP(nn.Module):
    """Top-k routing (softmax over the router's logits, the k largest renormalized) to Experts."""

    def __init__(self, d_model: int, n_expert: int, top_k: int, n_layer: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d_model, n_expert, bias=False)
        nn.init.normal_(self.router.weight, std=0.02)
        self.experts = Experts(n_expert, d_model, 4 * d_model, n_layer)

    def forward(self, x):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = self.router(tokens).float().softmax(dim=-1)
        weights, index = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(tokens.dtype)
        return self.experts(tokens, index, weights).reshape(shape)
