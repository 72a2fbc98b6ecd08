"""The config's schema: its eleven sections (the dataclasses of `Config`), every key's default and
what it decides about batch g (`setting`, BATCH_KINDS), and the values a choice key may take.

Every default lives here, in the dataclasses below, and nowhere else. docs/config.md lists them.
Reading a file is services/run/config/loading.py's; the checks a type cannot express are
services/run/config/checks.py's. This module must not import torch: the launcher uses it.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key and the source."""


# Every key says what it decides about batch g (services/run/runspec.py derives the checks from it):
#   "content"   the tokens of batch g: the packed data's cache key, the target/drafter handshake, resume
#   "path"      a data file whose contents decide batch g: cache key (by fingerprint) and resume, not the
#               handshake (hosts of one run may mount the same data at different places)
#   "capture"   what the target computes for batch g (features, labels): handshake and resume
#   "range"     which g exist: the handshake
#   "schedule"  which optimizer step trains batch g: resume
#   ""          nothing about batch g
BATCH_KINDS = ("content", "path", "capture", "range", "schedule", "")


def setting(default=None, *, batch: str, factory=None):
    """A config key with its default and what it decides about batch g (BATCH_KINDS)."""
    if batch not in BATCH_KINDS:
        raise ValueError(f"batch={batch!r}: expected one of {BATCH_KINDS}")
    meta = {"batch": batch}
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)


@dataclass
class RunConfig:
    name: str = setting("dflash", batch="")
    seed: int = setting(0, batch="content")
    epochs: int = setting(1, batch="range")
    max_steps: int = setting(0, batch="")  # 0 = run all epochs
    alloc_conf: str = setting("expandable_segments:True", batch="")  # PYTORCH_CUDA_ALLOC_CONF for GPU workers


@dataclass
class CheckpointConfig:
    every: int = setting(500, batch="")  # optimizer steps between checkpoints
    keep: int = setting(3, batch="")
    export_at_end: bool = setting(True, batch="")


@dataclass
class EvalConfig:
    every: int = setting(0, batch="")  # optimizer steps between held-out evaluations; 0 = none
    every_s: float = setting(-1.0, batch="")  # seconds of training between real-acceptance passes; -1: 300 on CUDA
    num_prompts: int = setting(
        16, batch=""
    )  # real speculative decoding on held-out prompts (rank 0, verified by the targets); 0 = off
    prompts: list[str] = setting(factory=list, batch="")  # prompt-set files (JSONL); [] = the held-out lines
    max_new_tokens: int = setting(128, batch="")
    budget_s: float = setting(60.0, batch="")  # per evaluation; prompts past it are left for the next one
    target_share: float = setting(0.25, batch="")  # verify work's share of a target's time while drafters ask
    sessions: int = setting(4, batch="")  # decode sessions a target holds at once (LRU; each holds a prompt's state)


@dataclass
class SuperviseConfig:
    stall_after_s: float = setting(300.0, batch="")  # health: main loop silent this long = stalled
    startup_stall_after_s: float = setting(1800.0, batch="")  # the same while loading the model and compiling
    unresponsive_after_s: float = setting(
        60.0, batch=""
    )  # a live worker whose health has answered before and then not this long (frozen)
    stop_timeout_s: float = setting(
        300.0, batch=""
    )  # SIGTERM: finish the step and checkpoint within this, else exit hard
    max_restarts: int = setting(3, batch="")  # per role, over the whole run
    rendezvous_timeout_s: float = setting(600.0, batch="")  # a drafter group across hosts: wait this for every host


@dataclass
class LogConfig:
    every: int = setting(1, batch="")  # optimizer steps per metrics line
    wandb_project: str = setting("", batch="")  # Weights & Biases project (the `wandb` extra); "" = off


@dataclass
class TargetConfig:
    model_path: str = setting("", batch="")  # local HF directory, HF repo id, or a .gguf file (converted once)
    layer_ids: list[int] = setting(
        factory=list, batch="capture"
    )  # empty = the default spread (docs/dflash.md); ascending, no repeats
    dtype: str = setting("bfloat16", batch="")
    quantize: str = setting("none", batch="")  # "fp8": decoder linears in FP8 (docs/guide/targets.md#fp8-targets)
    fp8_decode_gemm: str = setting("few-token", batch="")  # an FP8 target's decoding steps: "scaled" | "few-token"
    attn_implementation: str = setting("sdpa", batch="")
    compile: str = setting("auto", batch="")  # "auto" (on CUDA) | "on" | "off": regional torch.compile of the layers
    labels_from_target: bool = setting(
        True, batch="capture"
    )  # labels = target argmax, not data tokens (docs/guide/data.md#which-labels)


@dataclass
class DataConfig:
    path: str = setting("", batch="path")  # JSONL: chat, plain text (text / prompt + completion) or pre-tokenized
    eval_path: str = setting("", batch="path")  # optional held-out file
    eval_fraction: float = setting(0.0, batch="content")  # else: this fraction of documents is held out
    pack_len: int = setting(8192, batch="content")
    max_doc_len: int = setting(0, batch="content")  # 0 = pack_len; longer documents are split into pieces
    on_bad_sample: str = setting("fail", batch="content")  # "fail" | "skip"
    max_line_bytes: int = setting(8 << 20, batch="content")  # a longer JSONL line is a bad sample (never read whole)
    max_doc_tokens: int = setting(1 << 20, batch="content")  # a longer tokenized document is a bad sample
    shuffle: bool = setting(True, batch="content")
    chat_template_kwargs: dict = setting(
        factory=dict, batch="content"
    )  # chat-template variables, e.g. {enable_thinking = false}: training, eval prompts and regenerate render alike


@dataclass
class DrafterConfig:
    """The drafter's shape and what it is trained to predict."""

    num_layers: int = setting(5, batch="")
    block_size: int = setting(16, batch="")
    num_anchors: int = setting(512, batch="")
    gamma: float = setting(0.0, batch="")  # loss decay; 0 = 4 for B=16 (measured), scaled with block size
    position_weights: str = setting("decay", batch="")  # "decay" (gamma's) | "dpace" (from the drafter's confidence)
    dpace_alpha: float = setting(0.5, batch="")  # D-PACE's smoothing of the confidence: (1 - alpha) q + alpha
    # "domino" (DFlash + Domino's causal logit correction: more real acceptance, docs/benchmarks.md) | "dflash"
    objective: str = setting("domino", batch="")
    domino_emb_dim: int = setting(0, batch="")  # the correction's low rank (emb_dim); 0: min(256, width // 2)
    domino_gru_dim: int = setting(0, batch="")  # the GRU's state over the block's tokens; 0: min(1024, 2 x width)
    domino_lambda_start: float = setting(1.0, batch="")  # the base logits' share of the loss at step 0
    domino_decay_ratio: float = setting(0.5, batch="")  # ... falling linearly to 0 over this fraction of the run
    mask_token_id: int = setting(-1, batch="")  # -1 = tokenizer's mask token, else added <|MASK|>
    layer_types: list[str] = setting(
        factory=list, batch=""
    )  # per layer: full_attention | sliding_attention; [] = all full
    sliding_window: int = setting(0, batch="")  # W of the sliding_attention layers (0 = none; docs/dflash.md)
    overrides: dict = setting(factory=dict, batch="")  # drafter model config fields to override


@dataclass
class OptimizerConfig:
    lr: float = setting(6e-4, batch="")
    min_lr_ratio: float = setting(0.0, batch="")
    warmup_ratio: float = setting(0.04, batch="")
    weight_decay: float = setting(0.0, batch="")
    grad_clip: float = setting(1.0, batch="")
    max_nonfinite_steps: int = setting(
        8, batch=""
    )  # optimizer steps skipped in a row (non-finite data or gradient) before the run stops
    grad_accum: int = setting(1, batch="schedule")


@dataclass
class KernelsConfig:
    """How the drafter's step runs on the device (the numbers it trains to are the same)."""

    attention: str = setting("auto", batch="")  # "auto" | "flex" | "dense"; auto = flex on cuda, dense on cpu
    compile: bool = setting(True, batch="")
    loss_chunk: int = setting(2048, batch="")  # query rows per lm_head/CE chunk
    precision: str = setting("bf16", batch="")  # "bf16" | "fp8": the drafter linears' matmuls (docs/guide/drafter.md)


@dataclass
class TransportConfig:
    scheme: str = setting("ipc", batch="")  # "ipc" (one host) | "tcp"
    host: str = setting("127.0.0.1", batch="")  # tcp bind/connect address; loopback unless configured
    target_hosts: list[str] = setting(factory=list, batch="")  # per target rank, across hosts; [] = host
    drafter_hosts: list[str] = setting(factory=list, batch="")  # per drafter rank; [] = host
    base_port: int = setting(29600, batch="")  # tcp ports: base_port + offset per worker
    credits: int = setting(2, batch="")  # batches in flight per drafter
    resend_after_s: float = setting(
        0.0, batch=""
    )  # ask again for a batch not received after this long; 0 = 4x the slowest answer, 10-120 s
    chunk_bytes: int = setting(4 << 20, batch="")  # large tensors travel as a stream of messages this big
    max_message_bytes: int = setting(64 << 20, batch="")  # per ZMQ message; also ZMQ_MAXMSGSIZE
    max_batch_bytes: int = setting(4 << 30, batch="")  # a whole reassembled batch
    curve_keys_dir: str = setting("", batch="")  # tcp CURVE authentication when set
    allow_plaintext: bool = setting(
        False, batch=""
    )  # tcp without keys on a non-loopback address (trusted network only)
    dist_port: int = setting(29500, batch="")  # the drafter group's store across hosts (rank 0's host)
    insecure_rendezvous: bool = setting(
        False, batch=""
    )  # a drafter group across hosts without curve_keys_dir (its store then admits anyone)


@dataclass
class Config:
    """One section per component: each takes its own (with the run spec and a Placement), not the whole."""

    run: RunConfig = field(default_factory=RunConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    supervise: SuperviseConfig = field(default_factory=SuperviseConfig)
    log: LogConfig = field(default_factory=LogConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = [f.name for f in dataclasses.fields(Config)]


def section_class(name: str):
    """The dataclass of a section by its name ("target" -> TargetConfig)."""
    return typing.get_type_hints(Config)[name]


def value_of(cfg: Config, dotted: str):
    """cfg's value of "section.key"."""
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


# the values of the choice keys (checks.py refuses any other)
FULL, SLIDING = "full_attention", "sliding_attention"
TARGET_COMPILE = ("auto", "on", "off")
TARGET_DTYPES = (
    "bfloat16",
    "bf16",
    "float16",
    "fp16",
    "float32",
    "fp32",
)  # services/run/dtypes.py maps them to torch's
TARGET_QUANTIZE = ("none", "fp8")
FP8_DECODE_GEMMS = ("scaled", "few-token")  # services/target/model/fp8_few_tokens.py, its quantized mode
DRAFTER_PRECISIONS = ("bf16", "fp8")  # services/drafter/modeling/precision.py
POSITION_WEIGHTS = ("decay", "dpace")  # the loss weight of each block position (services/drafter/modeling/loss.py)
OBJECTIVES = ("dflash", "domino")  # what the drafter predicts with (services/drafter/modeling/domino.py)
