"""The frozen target: load an HF causal LM and capture the outputs of a few decoder layers.

    target = load_target(cfg.target, device, num_draft_layers=cfg.drafter.num_layers)
    hidden, labels = target.capture(input_ids, position_ids, document_ids, with_labels=False)

"Layer i" is the *output* of decoder layer i, which is HF `hidden_states[i + 1]` (docs/dflash.md; for
the last layer HF applies the final norm, and so does the capture).
Forward hooks on the captured layers copy their outputs into one [S, K*H] buffer (layer-id order
on the feature axis). Without labels the forward stops right after the deepest captured layer
(the hook raises a private exception), so the layers above it and the lm_head never run. With
labels the backbone runs to the end and argmax labels are computed in row chunks, so the full
[S, vocab] logits never exist at once. output_hidden_states is never used here.

Packed rows (several documents in one sequence) must not attend across documents. Every row is
passed with per-document position ids and the document spans:
  - target.attn_implementation = "sdpa" (default) runs SDPA once per document with is_causal=True
    (attention.py's "sdpa_packed"): exact, no S x S mask, keeps the fast causal kernels; on
    CUDA in float16/bfloat16 one varlen flash-attention call covers the whole row instead (chosen
    at load by packed_attention and logged; a float32 target keeps SDPA per document, since the
    varlen kernel takes half precision only);
  - flash_attention_* use HF's own varlen path from cu_seq_lens_q/k;
  - eager / flex_attention: HF detects the packing from the restarting position ids and builds
    the block-diagonal causal mask itself.
Models with recurrent layers (the Gated DeltaNet of Qwen3.5 / Qwen3.6) need more: their conv and
recurrence must restart at every document too. The capture path is chosen once, at load:
  - "packed": no recurrent layers; one forward per row;
  - "packed-varlen": Gated DeltaNet layers on CUDA with flash-linear-attention installed; one forward
    per row, the recurrent layers replaced by hybrid.PackedGatedDeltaNet (document-aware conv,
    chunked kernel with cu_seqlens);
  - "packed-reference": the same on other devices (CPU), with a plain per-token recurrence per
    document instead of the kernel (transformers would call fla's Triton kernels on CPU tensors
    wherever fla imports);
  - "per-document": CUDA without flash-linear-attention, or recurrent layers of another kind: one
    forward per document. Exact, and much slower on rows of many short documents; the log and
    `launcher status` say so, with the fix.
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from services.data.batch import FIELDS, document_spans
from services.net.handshake import CaptureShape
from services.run import dtypes, layers
from services.run.config import TARGET_QUANTIZE as QUANTIZE
from services.run.config import ConfigError, TargetConfig
from services.target.model import fp8, fp8_checkpoint, hybrid
from services.target.model.attention import PACKED_SDPA, register_packed_sdpa, varlen_attention
from services.target.model.compiled import compile_layers, compile_steps
from services.target.model.row import RowLayout, RowSlot

log = logging.getLogger("target")
DTYPES = dtypes.TARGET


class TargetLoadError(ConfigError):
    """The target model cannot be loaded as configured; the message names the path or key (exit 2)."""


class _StopForward(Exception):
    """Raised by the deepest capture hook to skip the rest of the forward."""


# --- layer ids -----------------------------------------------------------------------------------


def resolve_layer_ids(requested: list[int], num_layers: int, num_draft_layers: int) -> list[int]:
    """services.run.layers' rule (the launcher checks the same before starting workers)."""
    try:
        return layers.resolve_layer_ids(requested, num_layers, num_draft_layers)
    except ValueError as exc:
        raise TargetLoadError(str(exc)) from None


# --- loading -------------------------------------------------------------------------------------


def load_causal_lm(
    model_path: str | Path, dtype: torch.dtype, device, attn_implementation: str | None = None, fp8: bool = False
) -> nn.Module:
    """The one loader of a target folder, frozen on `device`: AutoConfig -> the causal-LM class; composite
    configs with a text_config load the text model; block-scaled FP8 checkpoints are dequantized.
    attn_implementation: transformers' name (None: its default). fp8: target.quantize = "fp8", the
    decoder's linears in FP8 as they reach the device (fp8_checkpoint.to_device_in_fp8)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(model_path)
    if not str(model_path) or not path.is_dir():
        raise TargetLoadError(f"target.model_path: model directory not found: {path}")
    if not (path / "config.json").is_file():
        raise TargetLoadError(f"target.model_path: no config.json in {path}")
    config = AutoConfig.from_pretrained(path)
    text_config = getattr(config, "text_config", None)
    if text_config is not None:  # Qwen3.5/3.6-style multimodal wrapper: we only need the text model
        config = text_config
    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise TargetLoadError(
            f"{path}/config.json: model type {config.model_type!r} has no causal-LM class in transformers"
        )
    impl = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    checkpoint = fp8_checkpoint.BlockScaledCheckpoint.open(path)  # None unless config.json declares FP8 blocks
    with fp8_checkpoint.loading(checkpoint, config):
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, **impl)
    model.eval().requires_grad_(False)
    if fp8:  # layer by layer: the device never holds the decoder whole in bf16
        log.info("%s", fp8_checkpoint.to_device_in_fp8(model, decoder_layers(model), checkpoint, device))
    else:
        model.to(device)
        if checkpoint is not None:  # the FP8 weights, exactly fp8 * scale_inv
            checkpoint.dequantize_into(model)
    return model


def load_hf_model(
    model_path: str | Path, dtype: torch.dtype, attn_implementation: str, device, fp8: bool = False
) -> nn.Module:
    """load_causal_lm for packed rows: target.attn_implementation "sdpa" runs as sdpa_packed (document by
    document)."""
    impl = attn_implementation
    if impl == "sdpa":
        register_packed_sdpa()
        impl = PACKED_SDPA
    return load_causal_lm(model_path, dtype, device, impl, fp8)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder's layer list: model.model.layers for Llama-likes, else the ModuleList of length L."""
    n = model.config.num_hidden_layers
    inner = getattr(model, "model", None)
    if inner is not None and isinstance(getattr(inner, "layers", None), nn.ModuleList) and len(inner.layers) == n:
        return inner.layers
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    raise TargetLoadError(f"cannot find the {n} decoder layers of {type(model).__name__}")


FLA_HINT = "pip install fla-core (flash-linear-attention's kernels; needs triton, which CUDA builds of torch bring)"


def choose_path(
    model: nn.Module, layers: nn.ModuleList, device: torch.device, slot: RowSlot, packed_recurrent: bool | None = None
) -> str:
    """The capture path (see the top of this file); on the packed-* paths of a hybrid its Gated
    DeltaNet layers are swapped for ones that read `slot`.

    packed_recurrent None picks by itself; False forces one forward per document (transformers' own
    code: the tests' reference); True forces the packed path even on CUDA without the kernels.
    """
    types = set(getattr(model.config, "layer_types", None) or [])
    if not types - {"full_attention", "sliding_attention"}:
        return "packed"
    kernel = hybrid.fla_delta_rule() if device.type == "cuda" else None
    # CUDA without the kernels: transformers' chunked torch code per document beats a per-token loop
    want = (kernel is not None or device.type != "cuda") if packed_recurrent is None else packed_recurrent
    if not want or types - {"full_attention", "sliding_attention", "linear_attention"}:
        return "per-document"
    if not hybrid.install(layers, kernel, slot):
        return "per-document"
    return "packed-varlen" if kernel is not None else "packed-reference"


VARLEN_DTYPES = (torch.float16, torch.bfloat16)  # what the varlen flash-attention kernel takes


def packed_attention(model: nn.Module, device: torch.device) -> tuple[bool, str]:
    """(varlen, description) of the attention of packed rows, chosen once at load.

    varlen: one varlen flash-attention call per row (sdpa_packed on CUDA, fp16/bf16, torch with the
    kernel). Otherwise sdpa_packed runs causal SDPA per document: exact in any dtype, so a
    float32 target on CUDA takes that path instead of failing in the kernel."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != PACKED_SDPA:
        return False, f"{impl} (transformers' own packed-sequence handling)"
    dtype = next(model.parameters()).dtype
    if device.type != "cuda":
        return False, "SDPA per document"
    if varlen_attention() is None:
        return False, "SDPA per document (this torch has no varlen flash attention: torch >= 2.10 has)"
    if dtype not in VARLEN_DTYPES:
        return False, (
            f"SDPA per document (target.dtype {str(dtype).removeprefix('torch.')}: the varlen "
            "flash-attention kernel takes float16/bfloat16 only; exact, slower on rows of many documents)"
        )
    return True, "varlen flash attention (one call per row)"


def slow_path_warning(path: str, device: torch.device) -> str:
    """One line for the log and `launcher status` when a hybrid target runs on the slow path."""
    if path != "per-document" or device.type != "cuda":
        return ""
    return f"hybrid target on the slow per-document capture path (one forward per document): {FLA_HINT}"


class Target:
    """A frozen HF causal LM with capture hooks on `layer_ids`."""

    def __init__(
        self, model: nn.Module, layer_ids: list[int], label_chunk: int = 2048, packed_recurrent: bool | None = None
    ):
        self.model = model
        self.backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.layers = decoder_layers(model)
        cfg = model.config
        self.info = CaptureShape(
            layer_ids=resolve_layer_ids(layer_ids, len(self.layers), len(layer_ids) or 1),
            hidden_size=cfg.hidden_size,
            vocab_size=cfg.vocab_size,
            num_layers=len(self.layers),
        )
        self.label_chunk = label_chunk
        self.device = next(model.parameters()).device
        self._out: torch.Tensor | None = None
        self._stop_after = True
        self.slot = RowSlot()
        for module in self.layers.modules():  # what sdpa_packed reads the row's spans from
            if type(module).__name__.endswith("Attention"):
                module.row_slot = self.slot
        self.path = choose_path(model, self.layers, self.device, self.slot, packed_recurrent)
        self.per_document = self.path == "per-document"
        self.varlen, self.attention = packed_attention(model, self.device)
        self._backend = ""  # the torch.compile backend, once compile() ran
        self.steps_backend = ""  # verify/slots.py's decoding steps run compiled layers of this backend (compile_steps)
        self.hf_varlen = str(getattr(model.config, "_attn_implementation", "")).startswith("flash_attention")
        self.warning = slow_path_warning(self.path, self.device)
        self._hooks: list = []
        self.capture_layers(self.info.layer_ids)

    @property
    def fp8_linears(self) -> bool:
        """Whether decoder linears run in FP8: their inputs rounded to e4m3 at every call, which widens
        the near-tie rule's rounding (services/decoding/decode_step.py rounding_tolerance)."""
        return any(isinstance(m, fp8.FP8Linear) for m in self.layers.modules())

    def capture_layers(self, layer_ids: list[int]) -> None:
        """Capture these layers (in range, each once; sorted here) from now on, in place of those before: how
        `launcher eval` serves checkpoints that read other layers than the run's config names."""
        if not layer_ids:
            raise ValueError("no layers to capture")
        layer_ids = layers.resolve_layer_ids(layer_ids, len(self.layers), len(layer_ids))  # in range, each once
        for handle in self._hooks:
            handle.remove()
        self.info = dataclasses.replace(self.info, layer_ids=list(layer_ids))
        h, deepest, last = self.info.hidden_size, layer_ids[-1], self.info.num_layers - 1
        self._hooks = [
            self.layers[i].register_forward_hook(self._make_hook(slice(k * h, (k + 1) * h), i == deepest, i == last))
            for k, i in enumerate(layer_ids)
        ]

    @property
    def compiled(self) -> str:
        """The torch.compile backend captures run with, "" for the eager layers (the slot decides)."""
        return self._backend if self.slot.compiled else ""

    def compile(self, backend: str = "inductor") -> None:
        """Compile every decoder layer for captures (compiled.py); decoding keeps the eager layers."""
        compile_layers(self.layers, self.slot, backend)
        self._backend, self.slot.compiled = backend, True

    def compile_steps(self, backend: str = "inductor") -> None:
        """Compile every decoder layer for verify/slots.py's decoding steps (compiled.compile_steps), once;
        steps_backend = "" turns them off again, this on."""
        if "step_forward" not in self.layers[0].__dict__:
            compile_steps(self.layers, self.slot, backend)
        self.steps_backend = backend

    @contextmanager
    def capturing_into(self, out: torch.Tensor):
        """For one full forward (to the final norm, nothing skipped), the hooks write the captured
        layers into out [S, K*H]: verify/decode.py's forwards, with the KV cache and logits."""
        self._out, self._stop_after = out, False
        try:
            yield out
        finally:
            self._out = None

    def _make_hook(self, cols: slice, deepest: bool, last: bool):
        def hook(_module, _args, output):
            if self._out is None:  # a plain forward of the model, not a capture
                return
            hidden = output[0] if isinstance(output, tuple) else output
            if last:  # HF's hidden_states[L] is the last layer's output after the final norm
                hidden = self.backbone.norm(hidden)
            self._out[:, cols].copy_(hidden.reshape(-1, hidden.shape[-1]))  # [1, S, H] or a batch [B, q, H]
            if deepest and self._stop_after:
                raise _StopForward

        return hook

    @torch.no_grad()
    def capture(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        document_ids: torch.Tensor,
        with_labels: bool = False,
        out: torch.Tensor | None = None,
        out_dtype: torch.dtype = FIELDS["hidden"],
        final_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One packed row [S] -> (hidden [S, K*H] on the model's device, argmax labels [S] or None).

        `out` (optional) is a reusable device buffer of that shape; else one is allocated.
        `final_out` [S, H] (optional) receives the last hidden states, after the final norm: the whole
        model runs (the packed speculative decoding of batched_decode.py takes its logits there).
        """
        s = int(input_ids.shape[0])
        if out is None:
            out = torch.empty(s, self.info.hidden_width, dtype=out_dtype, device=self.device)
        labels = torch.empty(s, dtype=torch.int64, device=self.device) if with_labels else None
        input_ids, position_ids = input_ids.to(self.device), position_ids.to(self.device)
        spans = document_spans(document_ids)
        if not self.per_document:
            self._forward(input_ids, position_ids, spans, out, labels, final_out)
            return out, labels
        for a, b in spans:
            self._forward(
                input_ids[a:b],
                position_ids[a:b],
                [(0, b - a)],
                out[a:b],
                labels[a:b] if labels is not None else None,
                final_out[a:b] if final_out is not None else None,
            )
        return out, labels

    def _forward(self, input_ids, position_ids, spans, out, labels, final_out=None) -> None:
        """Run the backbone on one row; hooks fill `out`; labels (if given) get the argmax, final_out
        (if given) the last hidden states."""
        cu = torch.tensor([a for a, _ in spans] + [int(input_ids.shape[0])], dtype=torch.int32, device=self.device)
        self.slot.layout = RowLayout(position_ids, cu, spans, self.varlen)
        kwargs = {}
        if (
            self.hf_varlen and not self.per_document
        ):  # transformers' own flash-attention varlen path reads the boundaries from kwargs
            longest = self.slot.layout.longest
            kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        self._out, self._stop_after = out, labels is None and final_out is None
        try:
            result = self.backbone(
                input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False, **kwargs
            )
        except _StopForward:
            return
        finally:
            self._out = None
            self.slot.layout = None
        if labels is not None:
            labels.copy_(self._argmax_labels(result.last_hidden_state[0]))
        if final_out is not None:
            final_out.copy_(result.last_hidden_state[0])

    def _argmax_labels(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """argmax of lm_head(final_hidden) in row chunks: never the whole [S, vocab] at once."""
        lm_head = self.model.get_output_embeddings()
        labels = torch.empty(final_hidden.shape[0], dtype=torch.int64, device=final_hidden.device)
        for start in range(0, final_hidden.shape[0], self.label_chunk):
            rows = slice(start, start + self.label_chunk)
            labels[rows] = lm_head(final_hidden[rows]).argmax(dim=-1)
        return labels


def load_target(cfg: TargetConfig, device: str | torch.device = "cpu", num_draft_layers: int = 1) -> Target:
    """Load cfg.model_path and set up capture of cfg.layer_ids (or the default spread for the drafter).

    The capture path is chosen here, once (Target.path); the worker logs it.
    """
    if cfg.dtype not in DTYPES:
        raise TargetLoadError(f"target.dtype must be one of {sorted(DTYPES)}, got {cfg.dtype!r}")
    if cfg.attn_implementation.startswith("flash_attention") and DTYPES[cfg.dtype] not in VARLEN_DTYPES:
        raise TargetLoadError(
            f"target.attn_implementation={cfg.attn_implementation} needs target.dtype bfloat16 "
            f"or float16, got {cfg.dtype} (or use target.attn_implementation=sdpa)"
        )
    if cfg.quantize not in QUANTIZE:
        raise TargetLoadError(f"target.quantize must be one of {', '.join(QUANTIZE)}, got {cfg.quantize!r}")
    quantize = cfg.quantize == "fp8"  # decoder linears in FP8 (fp8.py, fp8_checkpoint.py)
    model = load_hf_model(cfg.model_path, DTYPES[cfg.dtype], cfg.attn_implementation, device, fp8=quantize)
    if quantize and cfg.fp8_decode_gemm == "few-token":  # the scaled GEMM's numbers, faster at a step's few tokens
        count = fp8.few_token_steps(model, "quantized")
        log.info("target.fp8_decode_gemm=few-token: %d FP8 linears take decoding steps' few tokens", count)
    num_layers = len(decoder_layers(model))
    ids = resolve_layer_ids(cfg.layer_ids, num_layers, num_draft_layers)
    target = Target(model, ids)
    log.info("packed attention: %s", target.attention)
    return target


def capture_to_host(
    target: Target, row: dict[str, torch.Tensor], with_labels: bool = False, device_out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The worker's capture path: forward + capture on the device, then CPU tensors ready to send.

    On CUDA the hidden states are copied into a pinned host buffer from PyTorch's caching host
    allocator (reused once nothing holds the previous one); on CPU the capture is already there.
    """
    hidden, labels = target.capture(
        row["input_ids"], row["position_ids"], row["document_ids"], with_labels=with_labels, out=device_out
    )
    if hidden.device.type != "cuda":
        return hidden, labels
    host = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
    host.copy_(hidden, non_blocking=True)
    labels = labels.to("cpu", non_blocking=True) if labels is not None else None
    torch.cuda.current_stream().synchronize()
    return host, labels
