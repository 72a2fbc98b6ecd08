"""The shapes of a run, as plain data (no torch): what a target captures, what the drafter is
built as, and how both are read from a target's config.json. services/run/runspec.py resolves them
once per run; the target's model and the drafter's model read them from there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from services.run.config import FULL, SLIDING, check_layout

# The captured hidden states on the wire, by name (no torch here): services/data/batch.py's FIELDS["hidden"] is
# this dtype, and HIDDEN_BYTES its size per value (what one batch's hidden states weigh, for the run spec).
HIDDEN_DTYPE = "bfloat16"
HIDDEN_BYTES = 2


def captured_width(layer_ids: list[int], hidden_size: int) -> int:
    """hidden_width, the one definition: the captured layers' states side by side, K·H wide."""
    return len(layer_ids) * hidden_size


class CapturedWidth:
    @property
    def hidden_width(self) -> int:
        return captured_width(self.layer_ids, self.hidden_size)


@dataclass
class CaptureShape(CapturedWidth):
    """What a target captures: its layers (ascending, within [0, num_layers)), their width, its vocabulary."""

    layer_ids: list[int]
    hidden_size: int
    vocab_size: int
    num_layers: int


@dataclass
class DrafterModelConfig:
    """The drafter's shape (services/drafter/modeling/model.py builds it): the target's widths, its own layers."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    num_hidden_layers: int = 5
    target_layer_ids: list[int] = field(default_factory=list)
    block_size: int = 16
    mask_token_id: int = -1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    initializer_range: float = 0.02
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    layer_types: list[str] = field(default_factory=list)  # per draft layer; empty = all full_attention
    sliding_window: int | None = None  # W of the sliding_attention layers
    domino_emb_dim: int = 0  # Domino's correction head (services/drafter/modeling/domino.py): its low rank; 0 = none
    domino_gru_dim: int = 0  # ... and its GRU's width

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = [FULL] * self.num_hidden_layers
        check_layout(self.layer_types, self.sliding_window, self.num_hidden_layers)

    def window(self, layer_type: str) -> int | None:
        return self.sliding_window if layer_type == SLIDING else None

    @property
    def domino(self) -> bool:
        """Whether the drafter has Domino's causal correction head."""
        return self.domino_gru_dim > 0

    @property
    def num_captured(self) -> int:
        return len(self.target_layer_ids)

    @property
    def hidden_width(self) -> int:
        """Width of Batch.hidden: K captured layers of the target's width."""
        return captured_width(self.target_layer_ids, self.hidden_size)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_hf(self, dtype: str = "bfloat16") -> dict:
        """config.json of an export: the released z-lab drafters' fields at this shape
        (services/drafter/checkpoints/export.py says what each engine reads of it)."""
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        if self.domino:  # the fields SGLang's Domino drafter reads; our blocks predict a+k at position k
            dflash.update(
                projector_type="domino",
                emb_dim=self.domino_emb_dim,
                gru_hidden_dim=self.domino_gru_dim,
                shift_label=False,
                pure_draft_prefix_len=0,
            )
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "block_size": self.block_size,
            "dflash_config": dflash,
            "dtype": dtype,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": self.initializer_range,
            "intermediate_size": self.intermediate_size,
            "is_causal": False,
            "layer_types": list(self.layer_types),
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_target_layers": self.num_target_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": self.rope_theta,
            "sliding_window": self.sliding_window,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_cache": True,
            "use_sliding_window": self.sliding_window is not None,
            "vocab_size": self.vocab_size,
        }

    @classmethod
    def from_hf(cls, conf: dict) -> "DrafterModelConfig":
        """The shape of an export's (or a released drafter's) config.json: target_layer_ids and mask_token_id
        from dflash_config, else the top level; the layout fields when present."""
        dflash = conf.get("dflash_config") or {}
        domino = {}
        if dflash.get("projector_type") is not None:
            if dflash["projector_type"] != "domino":
                raise ValueError(f"dflash_config.projector_type {dflash['projector_type']!r}: only 'domino' is known")
            if dflash.get("shift_label") or dflash.get("pure_draft_prefix_len", 0):
                raise ValueError(
                    "dflash_config: a Domino drafter with shift_label true or pure_draft_prefix_len > 0 predicts "
                    "other block positions than this service's drafters (shift_label false, pure_draft_prefix_len 0)"
                )
            domino = {"domino_emb_dim": int(dflash["emb_dim"]), "domino_gru_dim": int(dflash["gru_hidden_dim"])}
        return cls(
            **{name: conf[name] for name in HF_REQUIRED},
            initializer_range=conf.get("initializer_range", 0.02),
            target_layer_ids=list(dflash.get("target_layer_ids", conf.get("target_layer_ids", []))),
            mask_token_id=dflash.get("mask_token_id", conf.get("mask_token_id", -1)),
            layer_types=list(conf.get("layer_types") or []),
            sliding_window=conf.get("sliding_window"),
            **domino,
        )


ARCHITECTURE = "DFlashDraftModel"  # what an export's config.json is read as (SGLang, vLLM)
# the fields an export's config.json must hold (from_hf); the others have defaults
HF_REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "num_target_layers",
    "num_hidden_layers",
    "block_size",
    "rms_norm_eps",
    "rope_theta",
    "attention_bias",
    "max_position_embeddings",
    "tie_word_embeddings",
)


MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(DrafterModelConfig))

# drafter model fields for a synthetic run without a target checkpoint; drafter.overrides apply on top
SYNTHETIC_MODEL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    num_target_layers=8,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    initializer_range=0.02,
    max_position_embeddings=4096,
)


def text_section(config: dict) -> tuple[dict, bool]:
    """(the text model's section, tie_word_embeddings) of a config.json: a multimodal wrapper's
    text_config (the target loads the text model alone), else the whole file."""
    text = config.get("text_config") or config
    return text, bool(config.get("tie_word_embeddings") or text.get("tie_word_embeddings"))


def _rope_theta(text: dict) -> float:
    theta = text.get("rope_theta")
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    return float(theta if theta is not None else 10000.0)


def target_fields(text: dict, tie: bool = False) -> dict:
    """The target-derived fields of DrafterModelConfig, from a text config as a dict (config.json's
    text section, or an HF config's to_dict()). A key the file leaves out takes the Llama-family
    default; KeyError names a key there is no default for."""
    heads = text["num_attention_heads"]
    return {
        "hidden_size": text["hidden_size"],
        "intermediate_size": text["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": text.get("num_key_value_heads") or heads,
        "head_dim": text.get("head_dim") or text["hidden_size"] // heads,
        "vocab_size": text["vocab_size"],
        "num_target_layers": text["num_hidden_layers"],
        "rms_norm_eps": float(text.get("rms_norm_eps", 1e-6)),
        "rope_theta": _rope_theta(text),
        "attention_bias": bool(text.get("attention_bias", False)),
        "initializer_range": float(text.get("initializer_range", 0.02)),
        "max_position_embeddings": int(text.get("max_position_embeddings", 40960)),
        "tie_word_embeddings": tie,
    }
