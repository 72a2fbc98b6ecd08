"""The DFlash drafter: a few non-causal Qwen3-style layers conditioned on target hidden states.

    ctx     = hidden_norm(fc(concat of K captured target layers))        [C, H], shared by every layer
    x       = embed(block tokens)   (anchor token, then mask tokens)      [Q, H]
    per layer (full_attention, or sliding_attention with a window: layer_types, sliding_window):
        h   = input_layernorm(x)
        q   = rope(q_norm(q_proj(h)))                  at the block positions
        k   = rope(k_norm(k_proj([ctx ; h])))          context at its positions, blocks at pos(a)+k
        v   = v_proj([ctx ; h])
        x   = x + o_proj(attention(q, k, v, the block mask of the layer's type))
        x   = x + mlp(post_attention_layernorm(x))
    out     = norm(x)                                                     [Q, H]

Parameter names follow the released z-lab drafters (layers.{i}.self_attn.q_proj.weight, fc.weight,
hidden_norm.weight, norm.weight ...), so the export is a plain state_dict. A Domino drafter
(drafter.objective = "domino") also has prefix_gru and embed_proj, its causal correction head,
which forward() does not run (domino.py does, after it). The embedding and lm_head
belong to the target: they live in TargetHead (target_head.py), never in this module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.drafter.modeling.domino import make_head
from services.run.config import FULL, SLIDING
from services.run.shapes import DrafterModelConfig  # the drafter's shape, resolved by services/run/runspec.py


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # statistics in fp32; the result keeps the input dtype (bf16 activations under autocast)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [len, head_dim] ([B, len, head_dim] for positions [B, len]) for integer
    positions, computed in fp32 (HF Qwen3 layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [..., len, head_dim / 2]: a row of positions or a batch
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., len, head_dim]; cos/sin [len, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, ctx, rope, attend, mask):
        """x [Q, H] block tokens (already layer-normed), ctx [C, H] context features; or a batch of
        padded rows, x [B, Q, H] and ctx [B, C, H] (many prompts decoded at once: services/target/verify/slots.py)."""
        batched = x.dim() == 3
        x, ctx = (x, ctx) if batched else (x[None], ctx[None])
        q_cos, q_sin, k_cos, k_sin = rope
        b, q_len, kv_len = x.shape[0], x.shape[1], ctx.shape[1] + x.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        # the same k/v projections for context and block; project separately, then concatenate
        # the (narrower) outputs instead of the inputs
        k = torch.cat([self.k_proj(ctx), self.k_proj(x)], 1).view(b, kv_len, self.num_kv_heads, self.head_dim)
        v = torch.cat([self.v_proj(ctx), self.v_proj(x)], 1).view(b, kv_len, self.num_kv_heads, self.head_dim)
        k = self.k_norm(k).transpose(1, 2)  # [B, kv_heads, KV, head_dim]
        v = v.transpose(1, 2)
        q = apply_rope(q, q_cos, q_sin)
        k = apply_rope(k, k_cos, k_sin)
        out = attend(q, k, v, mask)  # [B, heads, Q, head_dim]
        out = self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))
        return out if batched else out[0]


class MLP(nn.Module):
    def __init__(self, cfg: DrafterModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, ctx, rope, attend, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope, attend, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """Trainable drafter. state_dict() holds exactly what the export ships."""

    def __init__(self, cfg: DrafterModelConfig, attention=None):
        super().__init__()
        if cfg.num_captured < 1:
            raise ValueError("DrafterModelConfig.target_layer_ids is empty")
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(cfg.hidden_width, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.domino:
            self.prefix_gru, self.embed_proj = make_head(
                cfg.hidden_size, cfg.domino_emb_dim, cfg.domino_gru_dim, cfg.vocab_size
            )
        self.attention = attention  # a backend from attention.py; not a parameter
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None):
        """Qwen3 init: linear weights N(0, initializer_range), norms 1, biases 0; a GRU as torch's
        own, U(-1/sqrt(width), 1/sqrt(width))."""
        for module in self.modules():
            if isinstance(module, nn.GRU):
                for weight in module.parameters():
                    bound = module.hidden_size**-0.5
                    weight.uniform_(-bound, bound, generator=generator)
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, self.cfg.initializer_range, generator=generator)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def build_masks(self, anchors, context_starts, context_len: int) -> dict:
        """One block mask per layer type in use, from the attention backend: {layer_type: mask}."""
        return {
            kind: self.attention.build_mask(
                anchors, context_starts, self.cfg.block_size, context_len, self.cfg.window(kind)
            )
            for kind in sorted(set(self.cfg.layer_types))
        }

    def forward(self, hidden, block_embeds, context_positions, block_positions, masks):
        """hidden [C, K*H] target features; block_embeds [Q, H]; positions [C], [Q] -> [Q, H]. Or a
        batch of padded rows: [B, C, K*H], [B, Q, H], [B, C], [B, Q] -> [B, Q, H], masks [B, 1, Q, C+Q].
        masks: build_masks' dict, or one mask when every layer is full_attention."""
        cfg = self.cfg
        if not isinstance(masks, dict):
            if SLIDING in cfg.layer_types:
                raise ValueError("this drafter has sliding_attention layers: pass build_masks' dict, one mask per type")
            masks = {FULL: masks}
        ctx = self.hidden_norm(self.fc(hidden))
        q_cos, q_sin = rope_cos_sin(block_positions, cfg.head_dim, cfg.rope_theta)
        k_cos, k_sin = rope_cos_sin(torch.cat([context_positions, block_positions], -1), cfg.head_dim, cfg.rope_theta)
        rope = (q_cos, q_sin, k_cos, k_sin)  # keys: context at its positions, blocks at pos(a)+k
        if hidden.dim() == 3:  # a batch of rows: the tables broadcast over the heads
            rope = tuple(t[:, None] for t in rope)
        x = block_embeds
        for layer, kind in zip(self.layers, cfg.layer_types):
            x = layer(x, ctx, rope, self.attention, masks[kind])
        return self.norm(x)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def model_flops(cfg: DrafterModelConfig, seq_len: int, num_anchors: int, attended_pairs: dict) -> dict:
    """Useful FLOPs of one train step (forward + backward), counted as 2 per multiply-add.

    Trainable matmuls count 3x their forward (forward, input grad, weight grad). fc needs no input
    grad (2x); the frozen lm_head needs no weight grad (2x) and runs on the B-1 trained rows only.
    Attention counts only the pairs the mask keeps ({layer_type: pairs}), 3x forward (recomputation
    not counted).
    """
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_rows = num_anchors * cfg.block_size
    kv_rows = seq_len + q_rows
    per_layer = (
        2 * q_rows * H * cfg.num_attention_heads * D * 2  # q_proj, o_proj
        + 2 * kv_rows * H * cfg.num_key_value_heads * D * 2  # k_proj, v_proj
        + 2 * q_rows * H * I * 3
    )  # gate, up, down
    attention = sum(4 * attended_pairs[kind] * cfg.num_attention_heads * D for kind in cfg.layer_types)
    layers = 3 * (cfg.num_hidden_layers * per_layer + attention)
    fc = 2 * 2 * seq_len * cfg.hidden_width * H
    lm_head = 2 * 2 * num_anchors * (cfg.block_size - 1) * H * cfg.vocab_size
    return {"layers": layers, "attention": 3 * attention, "fc": fc, "lm_head": lm_head, "total": layers + fc + lm_head}
