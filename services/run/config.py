"""Run configuration: one TOML file, eleven sections (the dataclasses of `Config`), dotted CLI overrides.

Every default lives here, in the dataclasses below, and nowhere else. docs/config.md
lists them. This module must not import torch: the launcher uses it and stays light.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


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


def _section_class(name: str):
    return typing.get_type_hints(Config)[name]


# Keys that moved when [run] and [drafter] were split into sections per component: an old config
# file, override or a run's config.json still reads (from_dict, parse_override); docs/config.md lists them.
RENAMED = {
    "run.log_every": "log.every",
    "run.wandb_project": "log.wandb_project",
    "run.checkpoint_every": "checkpoint.every",
    "run.keep_checkpoints": "checkpoint.keep",
    "run.export_at_end": "checkpoint.export_at_end",
    "run.eval_every": "eval.every",
    "run.spec_eval_prompts": "eval.num_prompts",
    "run.eval_prompts": "eval.prompts",
    "run.spec_eval_max_new_tokens": "eval.max_new_tokens",
    "run.spec_eval_budget_s": "eval.budget_s",
    "run.spec_eval_target_share": "eval.target_share",
    "run.spec_eval_sessions": "eval.sessions",
    "run.stall_after_s": "supervise.stall_after_s",
    "run.startup_stall_after_s": "supervise.startup_stall_after_s",
    "run.unresponsive_after_s": "supervise.unresponsive_after_s",
    "run.stop_timeout_s": "supervise.stop_timeout_s",
    "run.max_restarts": "supervise.max_restarts",
    "run.rendezvous_timeout_s": "supervise.rendezvous_timeout_s",
    "drafter.lr": "optimizer.lr",
    "drafter.min_lr_ratio": "optimizer.min_lr_ratio",
    "drafter.warmup_ratio": "optimizer.warmup_ratio",
    "drafter.weight_decay": "optimizer.weight_decay",
    "drafter.grad_clip": "optimizer.grad_clip",
    "drafter.max_nonfinite_steps": "optimizer.max_nonfinite_steps",
    "drafter.grad_accum": "optimizer.grad_accum",
    "drafter.attention": "kernels.attention",
    "drafter.compile": "kernels.compile",
    "drafter.loss_chunk": "kernels.loss_chunk",
    "drafter.precision": "kernels.precision",
}


def upgrade(data: dict) -> dict:
    """A config as nested dicts (a TOML file, a run's config.json) with every renamed key at its place
    now. A key given under both names is an error, not a silent choice."""
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in data.items()}
    for old, new in RENAMED.items():
        (section, key), (new_section, new_key) = old.split("."), new.split(".")
        values = out.get(section)
        if not isinstance(values, dict) or key not in values:
            continue
        moved = out.setdefault(new_section, {})
        if not isinstance(moved, dict):
            continue  # from_dict says the section must be a table
        if new_key in moved:
            raise ConfigError(f"{old} and {new} are the same key (its old and new name): give it once")
        moved[new_key] = values.pop(key)
    return out


def _check_type(value, hint, where: str):
    """Return value coerced to hint (int->float only), or raise ConfigError naming `where`."""
    origin = typing.get_origin(hint)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool):
        if type(value) is not hint:
            raise ConfigError(f"{where}: expected {hint.__name__}, got {type(value).__name__} {value!r}")
        return value
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        return [_check_type(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table, got {type(value).__name__} {value!r}")
        return dict(value)
    raise ConfigError(f"{where}: unsupported type {hint}")  # pragma: no cover


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def from_dict(data: dict, source: str = "<dict>") -> Config:
    """Build a Config from nested dicts, rejecting unknown keys and wrong types."""
    cfg = Config()
    for section, values in upgrade(data).items():
        if section not in SECTIONS:
            raise ConfigError(f"{source}: unknown section [{section}] (known: {', '.join(SECTIONS)})")
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: [{section}] must be a table")
        _apply_section(cfg, section, values, source)
    return cfg


def _apply_section(cfg: Config, section: str, values: dict, source: str) -> None:
    target = getattr(cfg, section)
    hints = _hints(_section_class(section))
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"{source}: unknown key {section}.{key} (known: {', '.join(hints)})")
        setattr(target, key, _check_type(value, hints[key], f"{source}: {section}.{key}"))


def parse_override(text: str) -> tuple[str, str, object]:
    """'drafter.lr=3e-4' -> ('drafter', 'lr', 3e-4). Values are TOML literals; bare words are strings."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"override {text!r}: expected section.key=value")
    dotted, raw = text.split("=", 1)
    section, key = RENAMED.get(dotted.strip(), dotted.strip()).split(".", 1)
    return section, key, parse_value(raw)


def parse_value(raw: str) -> object:
    """A TOML literal ('false', '3e-4', '{a = 1}'); anything else is the bare string."""
    try:
        return tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        return raw.strip()


def toml_literal(value) -> str:
    """The TOML for a value parse_value reads back: {enable_thinking = false}, for advice lines."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        keys = [k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k) for k in value]
        return "{" + ", ".join(f"{k} = {toml_literal(v)}" for k, v in zip(keys, value.values())) + "}"
    raise TypeError(f"no TOML literal for {value!r}")


def _read(path: str | Path | None) -> tuple[dict, str]:
    """(the file's tables, its name for messages): a TOML, or a resolved JSON written by the launcher."""
    if not path:
        return {}, "<defaults>"
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        if path.suffix == ".json":
            return json.loads(path.read_text()), str(path)
        return tomllib.loads(path.read_text()), str(path)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except UnicodeDecodeError as exc:  # a binary or damaged file: named, not a traceback
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x})") from None


def old_names_used(path: str | Path | None, overrides: typing.Iterable[str] = ()) -> list[str]:
    """'old -> new' for each renamed key (RENAMED) that a config file or an override names by its old
    name: they still work, and the launcher says where they are now."""
    data, _ = _read(path)
    given = {f"{section}.{key}" for section, values in data.items() if isinstance(values, dict) for key in values}
    given |= {text.split("=", 1)[0].strip() for text in overrides}
    return [f"{old} -> {new}" for old, new in RENAMED.items() if old in given]


def load_config(path: str | Path | None = None, overrides: typing.Iterable[str] = ()) -> Config:
    """Load a TOML (or a resolved JSON written by the launcher) and apply dotted overrides."""
    data, source = _read(path)
    cfg = from_dict(data, source)
    for text in overrides:
        section, key, value = parse_override(text)
        if section not in SECTIONS:
            raise ConfigError(f"override {text!r}: unknown section [{section}]")
        _apply_section(cfg, section, {key: value}, "override")
    validate(cfg)
    return cfg


def value_of(cfg: Config, dotted: str):
    """cfg's value of "section.key"."""
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def validate(cfg: Config) -> None:
    """Cross-field checks that a type check cannot see."""

    def need(ok: bool, msg: str):
        if not ok:
            raise ConfigError(msg)

    def one_of(key: str, value, choices) -> None:
        need(value in choices, f"{key} must be one of {', '.join(choices)}, got {value!r}")

    need(
        cfg.data.on_bad_sample in ("fail", "skip"),
        f"data.on_bad_sample must be 'fail' or 'skip', got {cfg.data.on_bad_sample!r}",
    )
    need(
        cfg.data.max_line_bytes > 0 and cfg.data.max_doc_tokens > 0,
        "data.max_line_bytes and data.max_doc_tokens must be > 0",
    )
    need(cfg.data.pack_len > 0, f"data.pack_len must be > 0, got {cfg.data.pack_len}")
    need(0.0 <= cfg.data.eval_fraction < 1.0, f"data.eval_fraction must be in [0, 1), got {cfg.data.eval_fraction}")
    need(
        0 <= cfg.data.max_doc_len <= cfg.data.pack_len,
        f"data.max_doc_len={cfg.data.max_doc_len} is larger than data.pack_len={cfg.data.pack_len}: a document "
        "piece must fit in one row (0 = pack_len)",
    )
    one_of("target.dtype", cfg.target.dtype, TARGET_DTYPES)
    one_of("target.compile", cfg.target.compile, TARGET_COMPILE)
    one_of("target.quantize", cfg.target.quantize, TARGET_QUANTIZE)
    one_of("target.fp8_decode_gemm", cfg.target.fp8_decode_gemm, FP8_DECODE_GEMMS)
    o, k = cfg.optimizer, cfg.kernels
    need(o.grad_accum >= 1, f"optimizer.grad_accum must be >= 1, got {o.grad_accum}")
    need(k.attention in ("auto", "flex", "dense"), f"kernels.attention must be auto|flex|dense, got {k.attention!r}")
    one_of("kernels.precision", k.precision, DRAFTER_PRECISIONS)
    need(cfg.drafter.block_size >= 2, f"drafter.block_size must be >= 2, got {cfg.drafter.block_size}")
    need(cfg.drafter.num_anchors >= 1, f"drafter.num_anchors must be >= 1, got {cfg.drafter.num_anchors}")
    need(o.max_nonfinite_steps >= 1, f"optimizer.max_nonfinite_steps must be >= 1, got {o.max_nonfinite_steps}")
    need(cfg.drafter.num_layers >= 1, f"drafter.num_layers must be >= 1, got {cfg.drafter.num_layers}")
    d = cfg.drafter
    need(o.lr > 0 and math.isfinite(o.lr), f"optimizer.lr must be > 0, got {o.lr}")
    need(0 <= o.warmup_ratio < 1, f"optimizer.warmup_ratio must be in [0, 1), got {o.warmup_ratio}")
    need(0 <= o.min_lr_ratio <= 1, f"optimizer.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    need(o.weight_decay >= 0, f"optimizer.weight_decay must be >= 0, got {o.weight_decay}")
    need(o.grad_clip >= 0, f"optimizer.grad_clip must be >= 0 (0 = no clipping), got {o.grad_clip}")
    need(d.gamma >= 0, f"drafter.gamma must be >= 0 (0 = the default for the block size), got {d.gamma}")
    one_of("drafter.position_weights", d.position_weights, POSITION_WEIGHTS)
    need(0 < d.dpace_alpha <= 1, f"drafter.dpace_alpha must be in (0, 1], got {d.dpace_alpha}")
    one_of("drafter.objective", d.objective, OBJECTIVES)
    if d.objective == "domino":
        need(
            d.position_weights == "decay",
            'drafter.objective = "domino" trains with drafter.position_weights = "decay" only, got '
            f'{d.position_weights!r} (set drafter.objective = "dflash" for it)',
        )
        for key in ("domino_emb_dim", "domino_gru_dim"):
            need(
                getattr(d, key) >= 0,
                f"drafter.{key} must be >= 0 (0: sized by the drafter's width), got {getattr(d, key)}",
            )
        need(
            0 <= d.domino_lambda_start <= 1,
            f"drafter.domino_lambda_start must be in [0, 1], got {d.domino_lambda_start}",
        )
        need(0 < d.domino_decay_ratio <= 1, f"drafter.domino_decay_ratio must be in (0, 1], got {d.domino_decay_ratio}")
    need(k.loss_chunk >= 1, f"kernels.loss_chunk must be >= 1, got {k.loss_chunk}")
    need(cfg.run.max_steps >= 0, f"run.max_steps must be >= 0 (0 = every epoch), got {cfg.run.max_steps}")
    for dotted in ("checkpoint.every", "checkpoint.keep", "eval.every", "supervise.max_restarts"):
        need(value_of(cfg, dotted) >= 0, f"{dotted} must be >= 0, got {value_of(cfg, dotted)}")
    for dotted in (
        "supervise.stall_after_s",
        "supervise.startup_stall_after_s",
        "supervise.stop_timeout_s",
        "supervise.unresponsive_after_s",
        "supervise.rendezvous_timeout_s",
        "eval.budget_s",
    ):
        need(value_of(cfg, dotted) > 0, f"{dotted} must be > 0, got {value_of(cfg, dotted)}")
    need(
        cfg.transport.resend_after_s >= 0,
        f"transport.resend_after_s must be >= 0 (0: derived from answer times), got {cfg.transport.resend_after_s}",
    )
    for key in ("base_port", "dist_port"):
        need(
            0 < getattr(cfg.transport, key) < 65536,
            f"transport.{key} must be a port (1-65535), got {getattr(cfg.transport, key)}",
        )
    need(cfg.transport.scheme in ("ipc", "tcp"), f"transport.scheme must be ipc|tcp, got {cfg.transport.scheme!r}")
    need(cfg.transport.credits >= 1, f"transport.credits must be >= 1, got {cfg.transport.credits}")
    need(
        0 < cfg.transport.chunk_bytes <= cfg.transport.max_message_bytes,
        "transport.chunk_bytes must be > 0 and <= transport.max_message_bytes",
    )
    need(
        not plaintext_hosts(cfg.transport, loopback=False) or cfg.transport.allow_plaintext,
        f"transport.scheme=tcp on {', '.join(plaintext_hosts(cfg.transport, loopback=False))} without "
        "transport.curve_keys_dir: anyone who reaches that address could read hidden states and feed the drafters "
        "batches. Make keys with `launcher keys DIR` and set transport.curve_keys_dir=DIR on every host, or set "
        "transport.allow_plaintext=true on a network you trust completely",
    )
    e = cfg.eval
    need(e.num_prompts >= 0, f"eval.num_prompts must be >= 0, got {e.num_prompts}")
    need(e.every_s >= 0 or e.every_s == -1, f"eval.every_s must be >= 0 (0 = off) or -1 (by device), got {e.every_s}")
    need(0 < e.target_share <= 1, f"eval.target_share must be in (0, 1], got {e.target_share}")
    need(e.sessions >= 1, f"eval.sessions must be >= 1, got {e.sessions}")
    need(e.max_new_tokens >= 1, f"eval.max_new_tokens must be >= 1, got {e.max_new_tokens}")
    need(cfg.run.epochs >= 1, f"run.epochs must be >= 1, got {cfg.run.epochs}")
    need(ascending(cfg.target.layer_ids), layer_ids_message("target.layer_ids", cfg.target.layer_ids))
    need(
        cfg.drafter.sliding_window >= 0,
        f"drafter.sliding_window must be > 0 (or 0 for none), got {cfg.drafter.sliding_window}",
    )
    try:
        check_layout(
            cfg.drafter.layer_types or [FULL] * cfg.drafter.num_layers,
            cfg.drafter.sliding_window or None,
            cfg.drafter.num_layers,
            prefix="drafter.",
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


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
FP8_DECODE_GEMMS = ("scaled", "few-token")  # services/target/fp8_few_tokens.py, its quantized mode
DRAFTER_PRECISIONS = ("bf16", "fp8")  # services/drafter/modeling/precision.py
POSITION_WEIGHTS = ("decay", "dpace")  # the loss weight of each block position (services/drafter/modeling/loss.py)
OBJECTIVES = ("dflash", "domino")  # what the drafter predicts with (services/drafter/modeling/domino.py)


def check_layout(layer_types: list, sliding_window, num_layers: int, prefix: str = "") -> None:
    """Draft-layer attention layout, with the rules of SpecForge's resolve_dflash_attention_layout
    (docs/dflash.md): known types only, one per layer, a window > 0 exactly when a layer slides.
    ValueError naming the key (prefix + layer_types / sliding_window)."""
    if len(layer_types) != num_layers:
        raise ValueError(f"{prefix}layer_types has {len(layer_types)} entries, but the drafter has {num_layers} layers")
    for i, kind in enumerate(layer_types):
        if kind not in (FULL, SLIDING):
            raise ValueError(f"{prefix}layer_types[{i}] = {kind!r}: unknown layer type (known: {FULL}, {SLIDING})")
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window <= 0
    ):
        raise ValueError(f"{prefix}sliding_window must be an integer > 0, got {sliding_window!r}")
    if SLIDING in layer_types and sliding_window is None:
        raise ValueError(f"{prefix}layer_types has {SLIDING} layers but {prefix}sliding_window is not set")
    if SLIDING not in layer_types and sliding_window is not None:
        raise ValueError(
            f"{prefix}sliding_window = {sliding_window} is set but no layer in {prefix}layer_types is {SLIDING}"
        )


def is_loopback(host: str) -> bool:
    """localhost or a loopback address (a host name may resolve anywhere: not loopback)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def plaintext_hosts(transport: TransportConfig, loopback: bool) -> list[str]:
    """The tcp hosts of this run that would carry data in the clear (no CURVE keys): the loopback
    ones (loopback=True) or the others."""
    if transport.scheme != "tcp" or transport.curve_keys_dir:
        return []
    hosts = dict.fromkeys((transport.target_hosts or [transport.host]) + (transport.drafter_hosts or [transport.host]))
    return [h for h in hosts if is_loopback(h) == loopback]


def ascending(ids: list) -> bool:
    """Strictly increasing: sorted, no repeats."""
    return all(a < b for a, b in zip(ids, ids[1:]))


def layer_ids_message(key: str, ids: list) -> str:
    # The target concatenates the captured layers in ascending order whatever the list says, and
    # the export declares the list as that order: any other order would make engines feed the
    # features in an order the drafter never saw, with no error anywhere.
    return (
        f"{key} {ids} must be in ascending order without repeats (e.g. {sorted(set(ids))}): the captured "
        "layers are concatenated in ascending order, and the export declares this list as that order"
    )


def dump_json(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True))
