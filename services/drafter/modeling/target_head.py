"""What the drafter takes from the target checkpoint: its embedding and lm_head, and the mask token
id; its shape comes from the run spec (services/run/runspec.py). Only those two tensors are read
(safetensors, by name), never the whole model.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from services.drafter.modeling.model import DrafterModelConfig
from services.run import runspec
from services.run.config import ConfigError

MASK_TOKEN = "<|MASK|>"
_EMBED_NAMES = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "embed_tokens.weight",
)
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
        return cls(
            torch.randn(vocab_size, hidden_size, generator=gen) * 0.02,
            torch.randn(vocab_size, hidden_size, generator=gen) * (4.0 / hidden_size),
        )


# --- config -------------------------------------------------------------------------------


def check_mask(m: DrafterModelConfig, model_path: str = "", from_tokenizer: bool = False) -> DrafterModelConfig:
    """m, if its mask token has an embedding row; model_path: the tokenizer that suggests a spare token;
    from_tokenizer: the id was the tokenizer's choice, not drafter.mask_token_id."""
    if not 0 <= m.mask_token_id < m.vocab_size:
        spare = spare_special_token(model_path, m.vocab_size) if model_path else None
        example = f"e.g. drafter.mask_token_id={spare[0]} ({spare[1]})" if spare else "an unused special token's id"
        why = ": the tokenizer has no mask token and the embedding no spare row for one" if from_tokenizer else ""
        raise ConfigError(
            f"mask token id {m.mask_token_id} is outside the embedding ({m.vocab_size} rows){why}; "
            f"set drafter.mask_token_id to a special token the data never uses, {example}"
        )
    return m


def spare_special_token(model_path: str, vocab_size: int) -> tuple[int, str] | None:
    """(id, text) of the tokenizer's last special token that is not bos/eos/pad/unk and not in its
    chat template (SmolLM2: 16, <empty_output>); None when there is none or no tokenizer loads."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model_path)
    except Exception:
        return None
    template = tok.chat_template if isinstance(tok.chat_template, str) else json.dumps(tok.chat_template or "")
    spare = [
        (i, t.content)
        for i, t in tok.added_tokens_decoder.items()
        if t.special and i < vocab_size and i not in tok.all_special_ids and t.content not in template
    ]
    return max(spare) if spare else None


def resolve_mask_token_id(configured: int, model_path: str) -> int:
    """drafter.mask_token_id if >= 0; else the tokenizer's mask token; else the id <|MASK|> has
    (or would get when added: len(tokenizer)). Range is checked by check_mask."""
    if configured >= 0:
        return configured
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model_path)
    except Exception as exc:
        raise ConfigError(
            f"target.model_path={model_path!r}: cannot load the tokenizer to find the mask token "
            f"({exc}); set drafter.mask_token_id"
        ) from None
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
    matches = [
        n
        for n in names
        if n.endswith(suffix) and not any(w in n for w in ("visual", "vision", "audio", "talker", "mtp"))
    ]
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
            raise ConfigError(
                f"{model_path}: tensor {name} has shape {tuple(t.shape)}, config says [{vocab_size}, {hidden_size}]"
            )
    return TargetHead(embed, lm_head)


def from_target(spec: runspec.RunSpec) -> tuple[DrafterModelConfig, TargetHead]:
    """Everything the drafter needs from target.model_path, checked, on the CPU: the run spec's
    shape, the mask token, the embedding and lm_head."""
    if not spec.model_path:
        raise ConfigError("target.model_path is empty (use --synthetic for a run without a target)")
    shape = spec.model()
    mask_id = resolve_mask_token_id(shape.mask_token_id, spec.model_path)
    model_cfg = check_mask(dataclasses.replace(shape, mask_token_id=mask_id), spec.model_path, shape.mask_token_id < 0)
    head = load_target_head(spec.model_path, model_cfg.vocab_size, model_cfg.hidden_size, model_cfg.tie_word_embeddings)
    return model_cfg, head


def model_and_head(spec: runspec.RunSpec, seed: int) -> tuple[DrafterModelConfig, TargetHead]:
    """(model config, target head) on the CPU: every config error surfaces here, before GPU work.
    A synthetic run without a target checkpoint gets a random head of the spec's made-up shape."""
    if spec.model_path:
        return from_target(spec)
    model_cfg = check_mask(spec.model())
    return model_cfg, TargetHead.random(model_cfg.vocab_size, model_cfg.hidden_size, seed=seed)
