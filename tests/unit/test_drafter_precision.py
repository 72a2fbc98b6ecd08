"""kernels.precision: FP8 linears (torchao float8 training) keep the parameters, the names and the math.

On the CPU torchao emulates the FP8 matmuls (same scaling and rounding, plain matmuls), which checks
the conversion and the numerics; on CUDA the real FP8 GEMMs train side by side with bf16.
"""

import pytest
import torch

from services.drafter.modeling.model import DFlashDrafter
from services.drafter.modeling.precision import apply_precision
from services.drafter.modeling.target_head import TargetHead
from services.drafter.training.core import DrafterCore
from services.drafter.training.synthetic import SYNTHETIC_MODEL, SyntheticSource
from services.drafter.training.train import train_step
from services.run.config import ConfigError, load_config
from tests.drafters import build_model_config

pytest.importorskip("torchao.float8", reason="the fp8 extra (torchao) is not installed")


def model_config(*overrides):
    cfg = load_config(None, ["data.pack_len=256", "drafter.num_anchors=16", "drafter.num_layers=2", *overrides])
    return cfg, build_model_config(cfg, SYNTHETIC_MODEL, mask_token_id=SYNTHETIC_MODEL["vocab_size"] - 1)


def test_an_unknown_precision_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"kernels.precision must be one of bf16, fp8, got 'fp16'"):
        load_config(None, ['kernels.precision="fp16"'])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_fp8_on_the_cpu_is_refused_with_the_reason():
    cfg, model_cfg = model_config('kernels.precision="fp8"', "kernels.compile=false")
    head = TargetHead.random(model_cfg.vocab_size, model_cfg.hidden_size, seed=0)
    why = 'needs a CUDA GPU with FP8 matmuls; .* on cpu; kernels.precision="bf16" trains without it'
    with pytest.raises(ValueError, match=why):
        DrafterCore.build(cfg, model_cfg, head, "cpu", total_steps=1)


def test_fp8_keeps_every_parameter_and_name_and_stays_close_to_full_precision():
    _, model_cfg = model_config()
    torch.manual_seed(0)
    plain = DFlashDrafter(model_cfg, attention=None)
    fp8 = DFlashDrafter(model_cfg, attention=None)
    fp8.load_state_dict(plain.state_dict())
    apply_precision(fp8, "fp8", torch.device("cpu"), emulate=True)
    swapped = [name for name, m in fp8.named_modules() if type(m).__name__ == "Float8Linear"]
    linears = [name for name, m in plain.named_modules() if isinstance(m, torch.nn.Linear)]
    head = [name for name in linears if name.startswith("embed_proj.")]  # Domino's head: stays bf16, by design
    assert model_cfg.domino and head == ["embed_proj.0", "embed_proj.2"]
    backbone = [name for name in linears if name not in head]
    assert swapped == backbone and len(backbone) == 1 + 7 * model_cfg.num_hidden_layers
    assert list(fp8.state_dict()) == list(plain.state_dict())  # checkpoints and the export are unchanged

    from services.drafter.modeling.attention import make_attention

    plain.attention = fp8.attention = make_attention("dense", torch.device("cpu"))
    source = SyntheticSource(model_cfg, 256, total_steps=1)
    batch = next(iter(source))
    n_ctx, n_q = batch.seq_len, 4 * model_cfg.block_size
    gen = torch.Generator().manual_seed(1)
    embeds = torch.randn(n_q, model_cfg.hidden_size, generator=gen)
    anchors = torch.tensor([10, 60, 120, 200])
    ctx_pos = torch.arange(n_ctx)
    blk_pos = (anchors[:, None] + torch.arange(model_cfg.block_size)).flatten()
    masks = plain.build_masks(anchors, torch.zeros(4, dtype=torch.long), n_ctx)
    outs, grads = [], []
    for model in (plain, fp8):
        out = model(batch.hidden.float(), embeds, ctx_pos, blk_pos, masks)
        out.square().mean().backward()
        outs.append(out.detach())
        grads.append(model.layers[0].mlp.down_proj.weight.grad.clone())
    rel = lambda a, b: float((a - b).norm() / b.norm())
    assert rel(outs[1], outs[0]) < 0.1  # e4m3 keeps 3 mantissa bits: a few per cent, not more
    assert rel(grads[1], grads[0]) < 0.2 and grads[1].abs().sum() > 0
    assert rel(outs[1], outs[0]) > 0  # the FP8 rounding really ran


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real FP8 GEMMs need a CUDA GPU (compute capability 8.9+)")
def test_fp8_trains_like_bf16_on_cuda():
    losses = {}
    for precision in ("bf16", "fp8"):
        cfg, model_cfg = model_config(f'kernels.precision="{precision}"', "optimizer.lr=3e-3")
        head = TargetHead.random(model_cfg.vocab_size, model_cfg.hidden_size, seed=0)
        state = DrafterCore.build(cfg, model_cfg, head, "cuda", total_steps=30).state
        assert (state.fp8_head is not None) == (precision == "fp8")  # the loss's lm_head GEMMs in FP8 too
        source = SyntheticSource(
            model_cfg, cfg.data.pack_len, total_steps=30, device=torch.device("cuda"), with_target_labels=True
        )
        losses[precision] = [train_step(state, batch)["loss"] for batch in source]
    for precision, curve in losses.items():
        assert sum(curve[-5:]) < sum(curve[:5]) - 2.5, (precision, curve)  # both learn
    assert abs(sum(losses["fp8"][-5:]) - sum(losses["bf16"][-5:])) / sum(losses["bf16"][-5:]) < 0.1
