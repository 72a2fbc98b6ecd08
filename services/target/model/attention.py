"""The target's packed attention: causal attention inside each document of a row, never across.

    register_packed_sdpa()                                    # transformers' AttentionInterface knows PACKED_SDPA
    model.config._attn_implementation = PACKED_SDPA           # or load_hf_model(..., "sdpa", ...) in model.py

target.attn_implementation = "sdpa" (the default) runs as PACKED_SDPA: SDPA once per document with
is_causal=True (no S x S mask, the fast causal kernels kept), or on CUDA in float16/bfloat16 one
varlen flash-attention call for the whole row (model.packed_attention chooses it at load). The
document spans come from the row slot (row.py) of a capture, or from a doc_spans argument (the
decoding of verify/decode.py and verify/slots.py, plain forwards); a KV cache longer than the
queries is attended as one document. Out of model.py so that compiled.py, the decoding sessions and
the jobs use it without importing the loader (and compiled.py and model.py no longer import each other).
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

PACKED_SDPA = "sdpa_packed"
# Not cuDNN's SDPA where shapes change call by call (a document's length, a growing KV cache): it
# builds a plan on the host for every new shape (about 14 ms a call on an H200, bench/verify_step.py
# --profile), and a packed row of documents of other lengths than the last never reuses one: a
# Gemma-3 target's sliding-window layers, attended document by document, left the GPU 1 % busy.
# Flash and memory-efficient attention have no per-shape plan.
NO_CUDNN_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@torch.compiler.disable  # reads the row's document spans: not traced (compiled.py)
def sdpa_packed(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF attention function: causal attention inside each document span of the row, never across.

    query [B, Hq, S, D], key/value [B, Hkv, S, D]; returns ([B, S, Hq, D], None) like HF's sdpa.
    The spans come from the row slot the Target tagged the attention module with (a capture), or
    from a doc_spans argument (verify/decode.py, plain forwards). With layout.varlen (chosen at load by
    packed_attention) one varlen flash-attention call covers every document; else causal SDPA per
    document.
    """

    spans, layout = kwargs.pop("doc_spans", None), None
    slot = getattr(module, "row_slot", None)
    if spans is None and slot is not None and slot.slots is not None:  # many prompts, each on its KV cache
        return slot.slots.attend(module, query, key, value, kwargs.get("sliding_window"), scaling)
    if spans is None:
        layout = slot.layout if slot is not None else None
        if layout is None:
            raise RuntimeError(
                "sdpa_packed needs the row's document spans: run the model through Target.capture "
                "or pass doc_spans (or set target.attn_implementation to 'eager' or 'flex_attention')"
            )
        spans = layout.spans
    window = kwargs.pop("sliding_window", None)
    if key.shape[2] != query.shape[2]:  # decoding on top of a KV cache (verify/decode.py)
        return _sdpa_cached(module, query, key, value, spans, window, scaling)
    varlen = varlen_attention() if layout is not None and layout.varlen and len(spans) > 1 else None
    if varlen is not None and (window is None or varlen.windows):
        out = varlen(
            query[0].transpose(0, 1),
            key[0].transpose(0, 1),
            value[0].transpose(0, 1),
            layout.cu_seqlens,
            layout.longest,
            scaling,
            window,
        )
        return out[None], None
    b, hq, s, d = query.shape
    out = query.new_empty(b, s, hq, value.shape[-1])
    with sdpa_kernel(NO_CUDNN_SDPA):
        _sdpa_per_document(module, query, key, value, spans, window, scaling, out)
    return out, None


def _sdpa_per_document(module, query, key, value, spans, window, scaling, out) -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for start, end in spans:
        mask = None
        if window is not None and end - start > window:  # a sliding-window layer: band inside the document
            i = torch.arange(end - start, device=query.device)
            mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
        o, _ = sdpa_attention_forward(
            module,
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            mask,
            dropout=0.0,
            scaling=scaling,
        )
        out[:, start:end] = o


def _sdpa_cached(module, query, key, value, spans, window, scaling):
    """q_len new tokens after k_len - q_len cached ones, one document: causal aligned bottom-right
    (query i is at position k_len - q_len + i), banded for a sliding-window layer."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len, k_len = query.shape[2], key.shape[2]
    if len(spans) != 1:
        raise RuntimeError(f"sdpa_packed on a KV cache takes one document, got {len(spans)} spans")
    mask = None  # one new token that sees every cached one needs none
    if q_len > 1 or (window is not None and window < k_len):
        i = torch.arange(k_len - q_len, k_len, device=query.device)[:, None]
        j = torch.arange(k_len, device=query.device)[None, :]
        mask = (j <= i) if window is None else (j <= i) & (i - j < window)
    return sdpa_attention_forward(
        module,
        query,
        key,
        value,
        None if mask is None else mask[None, None],
        dropout=0.0,
        scaling=scaling,
        is_causal=False,
    )


@functools.cache
def varlen_attention():
    """torch's varlen flash attention (torch >= 2.10) as f(q, k, v, cu, max_len, scale), or None.

    q [T, Hq, D], k/v [T, Hkv, D], causal inside each span of cu; with `window` W, each query sees
    its last W keys (itself included: a sliding-window layer), where this torch takes a window
    (attend.windows). The keyword for "causal" and for grouped KV heads changed between torch
    releases, so both spellings are handled.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    gqa = "enable_gqa" in params

    def attend(q, k, v, cu, longest, scale, window=None):
        if k.shape[1] != q.shape[1] and not gqa:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        extra = {"enable_gqa": True} if gqa else {}
        band = causal if window is None else {"window_size": (window - 1, 0)}
        return varlen_attn(
            q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, longest, longest, scale=scale, **band, **extra
        )

    attend.windows = "window_size" in params
    return attend


def register_packed_sdpa() -> None:
    """Register sdpa_packed with transformers as PACKED_SDPA (then attn_implementation=PACKED_SDPA runs it)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_SDPA, sdpa_packed)
