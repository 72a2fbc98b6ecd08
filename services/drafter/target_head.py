"""What the drafter takes from the target checkpoint: its config, its embedding and lm_head, and
the mask token id. Only those two tensors are read (safetensors, by name), never the whole model.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from services.config import Config, ConfigError, ascending, layer_ids_message
from services.drafter.model import DrafterModelConfig
from services.layers import default_layer_ids, resolve_layer_ids

MASK_TOKEN = "<|MASK|>"
_EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
                "language_model.model.embed_tokens.weight", "embed_tokens.weight")
_LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight")


@dataclass
class TargetHead:
    """The target's frozen token embedding and output projection, [vocab, H] each."""
    embed: torch.Tensor
    lm_head: torch.Tensor

    @property
    def tied(self) -> bool:
        return self.embed is self.lm_head

    def to(self, device, dtype=None) -> "TargetHead":
        embed = self.embed.to(device=device, dtype=dtype)
        lm_head = embed if self.tied else self.lm_head.to(device=device, dtype=dtype)
        return TargetHead(embed.requires_grad_(False), lm_head.requires_grad_(False))

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed)

    @classmethod
    def random(cls, vocab_size: int, hidden_size: int, seed: int) -> "TargetHead":
        """Synthetic runs: a fixed-seed embedding and a separate lm_head whose logits (of a
        normed hidden state) have a spread of a few nats, so the loss can move."""
        gen = torch.Generator().manual_seed(seed)
        return cls(torch.randn(vocab_size, hidden_size, generator=gen) * 0.02,
                   torch.randn(vocab_size, hidden_size, generator=gen) * (4.0 / hidden_size))


# --- config -------------------------------------------------------------------------------

def load_text_config(model_path: str):
    """AutoConfig of the target; composite (multimodal) configs resolve to their text config.
    Returns (text_config, tie_word_embeddings)."""
    from transformers import AutoConfig

    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"target.model_path={model_path!r}: no config.json there")
    full = AutoConfig.from_pretrained(str(path))
    text = full.get_text_config(decoder=True) if hasattr(full, "get_text_config") else full
    tie = bool(getattr(full, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))
    return text, tie


def _rope_theta(text_cfg) -> float:
    theta = getattr(text_cfg, "rope_theta", None)
    params = getattr(text_cfg, "rope_parameters", None) or getattr(text_cfg, "rope_scaling", None) or {}
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    return float(theta if theta is not None else 10000.0)


def model_config_from_hf(text_cfg, tie: bool = False) -> dict:
    """The target-derived fields of DrafterModelConfig."""
    heads = text_cfg.num_attention_heads
    return {
        "hidden_size": text_cfg.hidden_size,
        "intermediate_size": text_cfg.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(text_cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // heads,
        "vocab_size": text_cfg.vocab_size,
        "num_target_layers": text_cfg.num_hidden_layers,
        "rms_norm_eps": float(getattr(text_cfg, "rms_norm_eps", 1e-6)),
        "rope_theta": _rope_theta(text_cfg),
        "attention_bias": bool(getattr(text_cfg, "attention_bias", False)),
        "initializer_range": float(getattr(text_cfg, "initializer_range", 0.02)),
        "max_position_embeddings": int(getattr(text_cfg, "max_position_embeddings", 40960)),
        "tie_word_embeddings": tie,
    }


def build_model_config(cfg: Config, base: dict, mask_token_id: int = -1) -> DrafterModelConfig:
    """base (from the target or the synthetic defaults) + drafter/target sections + drafter.overrides."""
    fields = {f.name for f in dataclasses.fields(DrafterModelConfig)}
    values = dict(base)
    values.update(num_hidden_layers=cfg.drafter.num_layers, block_size=cfg.drafter.block_size,
                  mask_token_id=mask_token_id, layer_types=list(cfg.drafter.layer_types),
                  sliding_window=cfg.drafter.sliding_window or None)
    if cfg.target.layer_ids:
        values["target_layer_ids"] = list(cfg.target.layer_ids)
    for key, value in cfg.drafter.overrides.items():
        if key not in fields:
            raise ConfigError(f"drafter.overrides.{key}: not a drafter model field (known: {', '.join(sorted(fields))})")
        values[key] = value
    if not values.get("target_layer_ids"):
        values["target_layer_ids"] = default_layer_ids(values["num_target_layers"], values["num_hidden_layers"])
    try:
        model_cfg = DrafterModelConfig(**values)
    except ValueError as exc:          # the attention layout (check_layout), after drafter.overrides
        raise ConfigError(f"drafter model config: {exc}") from None
    validate_model_config(model_cfg, cfg)
    return model_cfg


def validate_model_config(m: DrafterModelConfig, cfg: Config) -> None:
    def need(ok, msg):
        if not ok:
            raise ConfigError(msg)
    try:                                         # the target's rule (services/layers.py), on the drafter's side
        resolve_layer_ids(m.target_layer_ids, m.num_target_layers, len(m.target_layer_ids))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    need(ascending(m.target_layer_ids), layer_ids_message("target.layer_ids", m.target_layer_ids))
    need(m.num_attention_heads % m.num_key_value_heads == 0,
         f"num_attention_heads={m.num_attention_heads} is not a multiple of num_key_value_heads={m.num_key_value_heads}")
    need(m.head_dim % 2 == 0, f"head_dim={m.head_dim} must be even for RoPE")
    need(0 <= m.mask_token_id < m.vocab_size,
         f"mask token id {m.mask_token_id} is outside the embedding ({m.vocab_size} rows); "
         "set drafter.mask_token_id or use a tokenizer whose mask token fits")
    need(cfg.drafter.num_anchors <= cfg.data.pack_len,
         f"drafter.num_anchors={cfg.drafter.num_anchors} is larger than data.pack_len={cfg.data.pack_len}")
    need(m.block_size <= cfg.data.pack_len, f"drafter.block_size={m.block_size} is larger than data.pack_len={cfg.data.pack_len}")


def resolve_mask_token_id(configured: int, model_path: str) -> int:
    """drafter.mask_token_id if >= 0; else the tokenizer's mask token; else the id <|MASK|> has
    (or would get when added: len(tokenizer)). Range is checked by validate_model_config."""
    if configured >= 0:
        return configured
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(model_path)
    except Exception as exc:
        raise ConfigError(f"target.model_path={model_path!r}: cannot load the tokenizer to find the mask token "
                          f"({exc}); set drafter.mask_token_id") from None
    if tok.mask_token_id is not None:
        return int(tok.mask_token_id)
    return int(tok.get_vocab().get(MASK_TOKEN, len(tok)))


# --- tensors ------------------------------------------------------------------------------

def _tensor_index(model_path: Path) -> dict[str, Path]:
    """tensor name -> safetensors file, from model.safetensors.index.json or model.safetensors."""
    from safetensors import safe_open

    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{index}: no weight_map")
        return {name: model_path / file for name, file in weight_map.items()}
    single = model_path / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    raise ConfigError(f"target.model_path={str(model_path)!r}: no model.safetensors or model.safetensors.index.json")


def _pick(names: dict, preferred: tuple[str, ...], suffix: str) -> str | None:
    for name in preferred:
        if name in names:
            return name
    matches = [n for n in names if n.endswith(suffix) and not any(w in n for w in ("visual", "vision", "audio", "talker", "mtp"))]
    if len(matches) > 1:
        raise ConfigError(f"several candidate tensors for {suffix}: {matches}")
    return matches[0] if matches else None


def _read(index: dict, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(index[name]), framework="pt") as f:
        return f.get_tensor(name)


def load_target_head(model_path: str, vocab_size: int, hidden_size: int, tie: bool) -> TargetHead:
    path = Path(model_path)
    index = _tensor_index(path)
    embed_name = _pick(index, _EMBED_NAMES, "embed_tokens.weight")
    if embed_name is None:
        raise ConfigError(f"{model_path}: no embed_tokens.weight tensor in the checkpoint")
    embed = _read(index, embed_name)
    head_name = None if tie else _pick(index, _LM_HEAD_NAMES, "lm_head.weight")
    if head_name is None and not tie:
        raise ConfigError(f"{model_path}: tie_word_embeddings is false but there is no lm_head.weight tensor")
    lm_head = embed if head_name is None else _read(index, head_name)
    for name, t in ((embed_name, embed), (head_name or embed_name, lm_head)):
        if tuple(t.shape) != (vocab_size, hidden_size):
            raise ConfigError(f"{model_path}: tensor {name} has shape {tuple(t.shape)}, "
                              f"config says [{vocab_size}, {hidden_size}]")
    return TargetHead(embed, lm_head)


def from_target(cfg: Config) -> tuple[DrafterModelConfig, TargetHead]:
    """Everything the drafter needs from target.model_path, checked, on the CPU."""
    if not cfg.target.model_path:
        raise ConfigError("target.model_path is empty (use --synthetic for a run without a target)")
    text, tie = load_text_config(cfg.target.model_path)
    mask_id = resolve_mask_token_id(cfg.drafter.mask_token_id, cfg.target.model_path)
    model_cfg = build_model_config(cfg, model_config_from_hf(text, tie), mask_id)
    head = load_target_head(cfg.target.model_path, model_cfg.vocab_size, model_cfg.hidden_size, tie)
    return model_cfg, head


def model_and_head(cfg: Config, synthetic: bool) -> tuple[DrafterModelConfig, TargetHead]:
    """(model config, target head) on the CPU: every config error surfaces here, before GPU work.
    A synthetic run without a target checkpoint gets a random head of SYNTHETIC_MODEL's shape."""
    from services.drafter.synthetic import SYNTHETIC_MODEL
    if cfg.target.model_path or not synthetic:
        return from_target(cfg)
    vocab = cfg.drafter.overrides.get("vocab_size", SYNTHETIC_MODEL["vocab_size"])
    mask_id = cfg.drafter.mask_token_id if cfg.drafter.mask_token_id >= 0 else vocab - 1
    model_cfg = build_model_config(cfg, SYNTHETIC_MODEL, mask_id)
    return model_cfg, TargetHead.random(model_cfg.vocab_size, model_cfg.hidden_size, seed=cfg.run.seed)
