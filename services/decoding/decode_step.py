"""What speculative decoding needs from the target, whichever verifies: a Verifier, one prompt at a time,

    step = verifier.prefill(prompt_ids)      # a new prompt: Step for each prompt position
    step = verifier.verify(block_ids)        # the block at the next positions, on the committed context
    verifier.commit(n)                       # keep the first n >= 1 tokens of the block; the rest rolled back

served by the target workers (services/drafter/acceptance/remote_eval.py RemoteVerifier) or by a target in this
process (services/eval/verifier.py LocalVerifier, on services/target/verify/decode.py's DecodeSession); the
packed batched forward of services/eval/batched_decode.py returns Steps too.

A Step holds, per position, the target's greedy token (argmax of the logits), the top-1 minus
top-2 logit margin, the rounding tolerance of those logits (services/decoding/lossless.py's near-tie rule),
and the captured layers' outputs exactly as the target captures them for training.

ROLLBACKS names how a hybrid target's Gated DeltaNet state drops a rejected suffix
(services/target/model/hybrid.py implements them; `launcher eval --rollback` picks one).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from services.run.eval_options import ROLLBACKS  # noqa: F401  (declared with the options, without torch)


@dataclass
class Step:
    greedy: torch.Tensor  # [n] int64, argmax of the logits at each position
    margin: torch.Tensor  # [n] float32, top-1 minus top-2 logit
    tolerance: torch.Tensor  # [n] float32, the logits' rounding (a margin below it is a near-tie)
    features: torch.Tensor  # [n, K*H] the captured layers, in the model's dtype


class Verifier(Protocol):
    def prefill(self, prompt_ids: list[int]) -> Step: ...

    def verify(self, block_ids: list[int]) -> Step: ...

    def commit(self, n: int) -> None: ...


@dataclass
class Decoded:
    tokens: list[int]  # the new tokens (prompt excluded)
    steps: list[int]  # tokens committed by each verify forward: accepted drafts + 1
    target_forwards: int  # the prefill and one per step
    margins: list[float] = field(default_factory=list)  # per token: top-1 - top-2 logit of the forward that chose it
    tolerances: list[float] = field(default_factory=list)  # per token: that forward's rounding tolerance
    seconds: float = 0.0  # wall time of the decoding

    @classmethod
    def first(cls, step) -> "Decoded":
        """After the prefill: its last position's greedy token is the first new token."""
        return cls([int(step.greedy[-1])], [], 1, [float(step.margin[-1])], [float(step.tolerance[-1])])

    def accept(
        self,
        drafts: list[int],
        greedy: list[int],
        margins: list[float],
        tolerances: list[float],
        max_new_tokens: int,
        stop: set,
    ) -> int:
        """One verify step (greedy[j]: the target's token after the block's first j+1 tokens): the
        longest prefix of the drafts equal to the target's tokens, plus the target's own next token,
        cut at a stop token or the length limit, appended. Returns how many drafts were accepted."""
        accepted = next((j for j, (d, g) in enumerate(zip(drafts, greedy)) if d != g), len(drafts))
        new = drafts[:accepted] + [greedy[accepted]]
        for n, token in enumerate(new):
            if token in stop or len(self.tokens) + n + 1 >= max_new_tokens:
                new = new[: n + 1]
                break
        self.tokens += new
        self.margins += margins[: len(new)]
        self.tolerances += tolerances[: len(new)]
        self.steps.append(len(new))
        self.target_forwards += 1
        return accepted

    def done(self, max_new_tokens: int, stop: set) -> bool:
        return len(self.tokens) >= max_new_tokens or self.tokens[-1] in stop


NEAR_TIE_ULPS = 4
E4M3_EPS = torch.finfo(torch.float8_e4m3fn).eps  # 2^-3: e4m3 keeps 3 mantissa bits


def rounding_tolerance(top1: torch.Tensor, dtype: torch.dtype, fp8: bool = False) -> torch.Tensor:
    """NEAR_TIE_ULPS units of rounding of `dtype` at the logits' magnitude (at least 1): a margin
    below it can flip between two forwards that only round differently (docs/guide/acceptance.md).

    fp8: the target's decoder linears quantize their inputs to e4m3 at every call, so a difference
    of one unit of `dtype` in an input flips an e4m3 rounding with odds eps / E4M3_EPS, and each flip
    moves it by E4M3_EPS: the unit becomes sqrt(eps * E4M3_EPS), 4x bf16's (4-6x measured)."""
    eps = torch.finfo(dtype).eps
    unit = math.sqrt(eps * E4M3_EPS) if fp8 else eps
    return NEAR_TIE_ULPS * unit * top1.float().abs().clamp(min=1.0)


def logits_weight(lm_head: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What exact_logits multiplies by: a bf16 lm_head itself on CUDA, where a bf16 GEMM can write
    fp32 (torch.mm's out_dtype: exact products, fp32 sums, half the bytes of an fp32 copy: 2.5 GB
    less to read every step at a 27B target's 248 K vocabulary); its fp32 copy everywhere else."""
    if lm_head.device.type == "cuda" and dtype == torch.bfloat16 and mm_writes_fp32(lm_head.device):
        return lm_head.detach()
    return lm_head.detach().float()


@functools.cache
def mm_writes_fp32(device: torch.device) -> bool:
    """torch.mm(bf16, bf16, out_dtype=fp32) runs here (torch 2.8 and later on CUDA)."""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def exact_logits(hidden: torch.Tensor, lm_head: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 logits of a model computing in `dtype`: hidden (in dtype) @ lm_head.t() (logits_weight).

    Either way the products of bf16 values are exact and summed in fp32: a bf16 weight by a bf16 GEMM
    writing fp32; an fp32 copy of it by a TF32 tensor-core GEMM (a bf16 value has 8 significant bits,
    TF32 11), at several times the fp32 GEMM's speed (the lm_head of a 128 K vocabulary was the
    largest cost of a decoding step on an H200)."""
    if lm_head.dtype == torch.bfloat16:
        flat = torch.mm(hidden.reshape(-1, hidden.shape[-1]), lm_head.t(), out_dtype=torch.float32)
        return flat.view(*hidden.shape[:-1], -1)
    if hidden.device.type != "cuda" or dtype != torch.bfloat16:
        return hidden.float() @ lm_head.t()
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_tf32
    matmul.allow_tf32 = True
    try:
        return hidden.float() @ lm_head.t()
    finally:
        matmul.allow_tf32 = saved
