"""The config's checks that a key's type cannot express: one function per section (its ranges, its
choices, the keys it ties together), and validate(), which runs them all: load_config calls it.
Also the checks other modules share: the drafter's attention layout (check_layout: the config and
a checkpoint's shape), layer lists (ascending), and which tcp hosts would carry data in the clear.
Each raises ConfigError naming the key.
"""

from __future__ import annotations

import ipaddress
import math

from services.run.config.schema import (
    DRAFTER_PRECISIONS,
    FP8_DECODE_GEMMS,
    FULL,
    OBJECTIVES,
    POSITION_WEIGHTS,
    SLIDING,
    TARGET_COMPILE,
    TARGET_DTYPES,
    TARGET_QUANTIZE,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    DrafterConfig,
    EvalConfig,
    KernelsConfig,
    OptimizerConfig,
    RunConfig,
    SuperviseConfig,
    TargetConfig,
    TransportConfig,
)


def validate(cfg: Config) -> None:
    """Every section's checks, in one pass (the first error raises)."""
    check_data(cfg.data)
    check_target(cfg.target)
    check_optimizer(cfg.optimizer)
    check_kernels(cfg.kernels)
    check_drafter(cfg.drafter)
    check_run(cfg.run)
    check_checkpoint(cfg.checkpoint)
    check_supervise(cfg.supervise)
    check_eval(cfg.eval)
    check_transport(cfg.transport)


def need(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def one_of(key: str, value, choices) -> None:
    need(value in choices, f"{key} must be one of {', '.join(choices)}, got {value!r}")


def check_data(d: DataConfig) -> None:
    need(d.on_bad_sample in ("fail", "skip"), f"data.on_bad_sample must be 'fail' or 'skip', got {d.on_bad_sample!r}")
    need(d.max_line_bytes > 0 and d.max_doc_tokens > 0, "data.max_line_bytes and data.max_doc_tokens must be > 0")
    need(d.pack_len > 0, f"data.pack_len must be > 0, got {d.pack_len}")
    need(0.0 <= d.eval_fraction < 1.0, f"data.eval_fraction must be in [0, 1), got {d.eval_fraction}")
    need(
        0 <= d.max_doc_len <= d.pack_len,
        f"data.max_doc_len={d.max_doc_len} is larger than data.pack_len={d.pack_len}: a document "
        "piece must fit in one row (0 = pack_len)",
    )


def check_target(t: TargetConfig) -> None:
    one_of("target.dtype", t.dtype, TARGET_DTYPES)
    one_of("target.compile", t.compile, TARGET_COMPILE)
    one_of("target.quantize", t.quantize, TARGET_QUANTIZE)
    one_of("target.fp8_decode_gemm", t.fp8_decode_gemm, FP8_DECODE_GEMMS)
    need(ascending(t.layer_ids), layer_ids_message("target.layer_ids", t.layer_ids))


def check_optimizer(o: OptimizerConfig) -> None:
    need(o.grad_accum >= 1, f"optimizer.grad_accum must be >= 1, got {o.grad_accum}")
    need(o.max_nonfinite_steps >= 1, f"optimizer.max_nonfinite_steps must be >= 1, got {o.max_nonfinite_steps}")
    need(o.lr > 0 and math.isfinite(o.lr), f"optimizer.lr must be > 0, got {o.lr}")
    need(0 <= o.warmup_ratio < 1, f"optimizer.warmup_ratio must be in [0, 1), got {o.warmup_ratio}")
    need(0 <= o.min_lr_ratio <= 1, f"optimizer.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    need(o.weight_decay >= 0, f"optimizer.weight_decay must be >= 0, got {o.weight_decay}")
    need(o.grad_clip >= 0, f"optimizer.grad_clip must be >= 0 (0 = no clipping), got {o.grad_clip}")


def check_kernels(k: KernelsConfig) -> None:
    need(k.attention in ("auto", "flex", "dense"), f"kernels.attention must be auto|flex|dense, got {k.attention!r}")
    one_of("kernels.precision", k.precision, DRAFTER_PRECISIONS)
    need(k.loss_chunk >= 1, f"kernels.loss_chunk must be >= 1, got {k.loss_chunk}")


def check_drafter(d: DrafterConfig) -> None:
    need(d.block_size >= 2, f"drafter.block_size must be >= 2, got {d.block_size}")
    need(d.num_anchors >= 1, f"drafter.num_anchors must be >= 1, got {d.num_anchors}")
    need(d.num_layers >= 1, f"drafter.num_layers must be >= 1, got {d.num_layers}")
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
    need(d.sliding_window >= 0, f"drafter.sliding_window must be > 0 (or 0 for none), got {d.sliding_window}")
    try:
        check_layout(d.layer_types or [FULL] * d.num_layers, d.sliding_window or None, d.num_layers, prefix="drafter.")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_run(r: RunConfig) -> None:
    need(r.max_steps >= 0, f"run.max_steps must be >= 0 (0 = every epoch), got {r.max_steps}")
    need(r.epochs >= 1, f"run.epochs must be >= 1, got {r.epochs}")


def check_checkpoint(c: CheckpointConfig) -> None:
    for key in ("every", "keep"):
        need(getattr(c, key) >= 0, f"checkpoint.{key} must be >= 0, got {getattr(c, key)}")


def check_supervise(s: SuperviseConfig) -> None:
    need(s.max_restarts >= 0, f"supervise.max_restarts must be >= 0, got {s.max_restarts}")
    for key in (
        "stall_after_s",
        "startup_stall_after_s",
        "stop_timeout_s",
        "unresponsive_after_s",
        "rendezvous_timeout_s",
    ):
        need(getattr(s, key) > 0, f"supervise.{key} must be > 0, got {getattr(s, key)}")


def check_eval(e: EvalConfig) -> None:
    need(e.every >= 0, f"eval.every must be >= 0, got {e.every}")
    need(e.budget_s > 0, f"eval.budget_s must be > 0, got {e.budget_s}")
    need(e.num_prompts >= 0, f"eval.num_prompts must be >= 0, got {e.num_prompts}")
    need(e.every_s >= 0 or e.every_s == -1, f"eval.every_s must be >= 0 (0 = off) or -1 (by device), got {e.every_s}")
    need(0 < e.target_share <= 1, f"eval.target_share must be in (0, 1], got {e.target_share}")
    need(e.sessions >= 1, f"eval.sessions must be >= 1, got {e.sessions}")
    need(e.max_new_tokens >= 1, f"eval.max_new_tokens must be >= 1, got {e.max_new_tokens}")


def check_transport(t: TransportConfig) -> None:
    need(
        t.resend_after_s >= 0,
        f"transport.resend_after_s must be >= 0 (0: derived from answer times), got {t.resend_after_s}",
    )
    for key in ("base_port", "dist_port"):
        need(0 < getattr(t, key) < 65536, f"transport.{key} must be a port (1-65535), got {getattr(t, key)}")
    need(t.scheme in ("ipc", "tcp"), f"transport.scheme must be ipc|tcp, got {t.scheme!r}")
    need(t.credits >= 1, f"transport.credits must be >= 1, got {t.credits}")
    need(
        0 < t.chunk_bytes <= t.max_message_bytes,
        "transport.chunk_bytes must be > 0 and <= transport.max_message_bytes",
    )
    need(
        not plaintext_hosts(t, loopback=False) or t.allow_plaintext,
        f"transport.scheme=tcp on {', '.join(plaintext_hosts(t, loopback=False))} without "
        "transport.curve_keys_dir: anyone who reaches that address could read hidden states and feed the drafters "
        "batches. Make keys with `launcher keys DIR` and set transport.curve_keys_dir=DIR on every host, or set "
        "transport.allow_plaintext=true on a network you trust completely",
    )


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
