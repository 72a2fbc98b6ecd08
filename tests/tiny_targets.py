"""Tiny random targets for the decoding tests, made on the spot and wrapped in the training Target:
a dense Qwen3 and a Qwen3.5 hybrid (Gated DeltaNet, every 4th layer full attention), fp32 on CPU
(the hybrid also on CUDA, where flash-linear-attention's kernels run it), attention through the
packed SDPA function as load_target sets it up."""

from contextlib import contextmanager

import pytest
import torch

from services.target.model.attention import PACKED_SDPA, register_packed_sdpa
from services.target.model.model import Target

VOCAB = 96
DENSE_LAYER_IDS = [1, 2]
HYBRID_LAYER_IDS = [1, 3, 7]  # a Gated DeltaNet layer, a full-attention layer, the last (final norm)
HYBRID_TYPES = ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]


def tiny_hybrid_config(layer_types: list[str], vocab_size: int, **fields):
    """A tiny Qwen3.5 text config (Gated DeltaNet + full attention), one layer per entry of layer_types:
    the one hybrid shape of the tests; fields add to or override it."""
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    shape = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    return Qwen3_5TextConfig(**{**shape, **fields})


def _wrap(model, layer_ids) -> Target:
    with torch.no_grad():  # a spread of logits, so greedy output is not one token repeated
        model.lm_head.weight.mul_(20)
    register_packed_sdpa()
    model.config._attn_implementation = PACKED_SDPA
    return Target(model.eval().requires_grad_(False), layer_ids)


def dense_target(seed: int = 0, device: str = "cpu", dtype=torch.float32) -> Target:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    return _wrap(Qwen3ForCausalLM(cfg).to(device, dtype), DENSE_LAYER_IDS)


def cuda_with_kernels() -> bool:
    from services.target.model.hybrid import fla_delta_rule

    return torch.cuda.is_available() and fla_delta_rule() is not None


# the devices a hybrid decoding test runs on: CUDA only where the kernels are (the GPU path users run)
HYBRID_DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not cuda_with_kernels(), reason="needs CUDA and flash-linear-attention")
    ),
]


def hybrid_target(seed: int = 0, device: str = "cpu", dtype=torch.float32) -> Target:
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_hybrid_config(HYBRID_TYPES, VOCAB, bos_token_id=None, eos_token_id=None)
    target = _wrap(Qwen3_5ForCausalLM(cfg).to(device, dtype), HYBRID_LAYER_IDS)
    assert target.path == ("packed-reference" if device == "cpu" else "packed-varlen")
    return target


@contextmanager
def plain_hf(target: Target):
    """The target's HF model with HF's own sdpa, for transformers' generate (it passes no document spans)."""
    cfg = target.model.config
    saved, cfg._attn_implementation = cfg._attn_implementation, "sdpa"
    try:
        yield target.model
    finally:
        cfg._attn_implementation = saved


def prompt(seed: int, n: int = 12) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
