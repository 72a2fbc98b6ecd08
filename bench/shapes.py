"""Target model shapes the benchmarks build with random weights (no download), shared by all of them.

Qwen3 shapes follow the published config.json of Qwen/Qwen3-8B and Qwen/Qwen3-32B. The hybrid
shape is the text model of Qwen3.6-27B (Qwen3.5 family, the users' target): 64 layers, every 4th
full attention and the rest Gated DeltaNet, 24/4 heads x 256, linear attention 16 key / 48 value
heads x 128, conv kernel 4, vocab 248320, partial rotary 0.25, rope theta 1e7 (26.9 B parameters).
"""

from __future__ import annotations

QWEN3 = {
    "tiny": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=8,
        num_attention_heads=4,  # CPU smoke test
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=4096,
    ),
    "135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,  # SmolLM2-135M's
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
    ),  # widths (Llama)
    "8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    ),
    "32b": dict(
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    ),
}
HYBRID = {
    "tiny-hybrid": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        vocab_size=4096,
    ),
    "0.8b-hybrid": dict(  # a sub-1B member of the family: 18 Gated DeltaNet + 6 full attention layers
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        vocab_size=248320,
    ),
    "27b-hybrid": dict(
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        vocab_size=248320,
    ),
}
SHAPES = sorted(QWEN3) + sorted(HYBRID)


def text_config(shape: str):
    """The transformers config of a shape's text model."""
    from transformers import Qwen3Config
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    if shape in QWEN3:
        return Qwen3Config(
            max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, **QWEN3[shape]
        )
    rope = {
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    }
    return Qwen3_5TextConfig(
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        rope_parameters=rope,
        tie_word_embeddings=False,
        **HYBRID[shape],
    )


def checkpoint_config(shape: str):
    """What goes into config.json: the composite multimodal config for hybrid shapes, as the real
    Qwen3.6-27B checkpoint is saved (Qwen3_5ForConditionalGeneration), else the text config."""
    if shape in QWEN3:
        return text_config(shape)
    from transformers.models.qwen3_5 import Qwen3_5Config

    return Qwen3_5Config(
        text_config=text_config(shape).to_dict(),
        vision_config=dict(depth=2, out_hidden_size=HYBRID[shape]["hidden_size"]),
    )
