"""What a run is, resolved once from its config and the target's config.json (no torch, no weights:
the launcher uses it).

    spec = runspec.resolve(cfg)               # the one function that works it out
    spec.save(run_dir)                        # `launcher up`, before any worker starts: <run_dir>/runspec.json
    spec = runspec.for_worker(cfg, run_dir)   # a worker: runspec.json when there is one, else resolve(cfg)

A spec holds (docs/guide/running.md, "The run spec"):
  - target: the layers the target captures (services/run/layers.py's rule), its width H, vocabulary,
    depth, and hidden_width = K·H (services/run/shapes.py CaptureShape);
  - drafter: the drafter model's shape (shapes.DrafterModelConfig): the target's widths, drafter.*
    and drafter.overrides; mask_token_id -1 means the tokenizer's, which the drafter resolves;
  - held_out: which data the held-out split is (HeldOut);
  - batch_keys: the config keys that decide batch g, each with its mark and value (below);
  - config: the resolved config it was resolved from (a worker started with another refuses it).
A target compares what it loaded with the spec, and a drafter compares what its targets say
they loaded (the handshake, services/net/handshake.py) with its own.

What decides batch g is read from the marks on the config keys (services/run/config/schema.py `setting`),
so a key added to the config is covered by every check as soon as it is marked (and
tests/unit/test_runspec.py fails for a key with no mark):
  - the packed data's cache key (services/target/batches/packing.py): "content" keys and "path" files;
  - the target/drafter handshake digest: "content", "capture", "range";
  - the resume check of a checkpoint (services/drafter/checkpoints/checkpoint.py): "content", "path", "capture",
    "schedule".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from services.run import layers, shapes
from services.run.config import (
    BATCH_KINDS,
    SECTIONS,
    Config,
    ConfigError,
    TargetConfig,
    ascending,
    layer_ids_message,
    section_class,
    value_of,
)
from services.run.files import write_json_atomic

FILE = "runspec.json"
FORMAT = 1
CACHE_KINDS = ("content", "path")
HANDSHAKE_KINDS = ("content", "capture", "range")
RESUME_KINDS = ("content", "path", "capture", "schedule")
DECIDING = tuple(kind for kind in BATCH_KINDS if kind)
_EVAL_SALT = 0xE7A1


class SpecError(ConfigError):
    """The run cannot be resolved, or what was loaded is not what the spec says; one line naming the field."""


# --- the keys that decide batch g ------------------------------------------------------------------


def keys_deciding(kinds: tuple[str, ...]) -> list[str]:
    """The dotted config keys ("data.pack_len") whose mark is one of `kinds`, in declaration order."""
    return [
        f"{section}.{f.name}"
        for section in SECTIONS
        for f in dataclasses.fields(section_class(section))
        if f.metadata.get("batch") in kinds
    ]


def values(cfg: Config, kinds: tuple[str, ...]) -> dict:
    """{dotted key: value} of the keys marked with one of `kinds`."""
    return {dotted: value_of(cfg, dotted) for dotted in keys_deciding(kinds)}


def digest(picked: dict) -> str:
    """sha256 (16 hex) of {dotted key: value}: what the handshake compares."""
    return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()[:16]


def batch_keys_of(cfg: Config) -> dict:
    """{dotted key: {"decides": mark, "value": value}} of every key that decides batch g (a run spec's batch_keys)."""
    marks = {f"{s}.{f.name}": f.metadata["batch"] for s in SECTIONS for f in dataclasses.fields(section_class(s))}
    return {k: {"decides": marks[k], "value": v} for k, v in values(cfg, DECIDING).items()}


def handshake_digest(batch_keys: dict) -> str:
    """The handshake's digest (RunSpec.config_digest): the keys of batch_keys marked HANDSHAKE_KINDS,
    the ones both sides must agree on. File paths are left out: hosts of one run may mount the same
    data at different places."""
    return digest({k: v["value"] for k, v in batch_keys.items() if v["decides"] in HANDSHAKE_KINDS})


# --- the held-out split ----------------------------------------------------------------------------


@dataclass(frozen=True)
class HeldOut:
    """Which data is held out: data.eval_path; else a data.eval_fraction of the non-blank lines of
    data.path, by line number (lines(); at least one, never all): a held-out line that is bad is
    missing from the packed eval split and from the eval's prompts alike, and no other line moves
    in or out because of it; else none. The packed data (services/target/batches/packing.py) and the eval's
    prompts read it from here."""

    source: str  # "data.eval_path" | "data.eval_fraction" | "" (no held-out split)
    path: str  # the file the split is, or is cut from
    fraction: float
    seed: int  # run.seed

    @classmethod
    def of(cls, cfg: Config) -> "HeldOut":
        d = cfg.data
        if d.eval_path:
            return cls("data.eval_path", d.eval_path, 0.0, cfg.run.seed)
        if d.eval_fraction > 0:
            return cls("data.eval_fraction", d.path, d.eval_fraction, cfg.run.seed)
        return cls("", "", 0.0, cfg.run.seed)

    @property
    def exists(self) -> bool:
        return bool(self.source)

    def indices(self, count: int) -> list[int]:
        """Which of `count` items (count > 1) are held out under data.eval_fraction, sorted."""
        import numpy as np

        n_eval = min(count - 1, max(1, round(self.fraction * count)))
        return sorted(np.random.default_rng([self.seed, _EVAL_SALT]).permutation(count)[:n_eval].tolist())

    def lines(self, line_numbers: list[int]) -> set[int]:
        """The held-out ones of data.path's non-blank line numbers (services/data_lines.nonblank_lines)."""
        return {line_numbers[i] for i in self.indices(len(line_numbers))} if len(line_numbers) > 1 else set()


# --- the target's config.json ----------------------------------------------------------------------


def text_config_of(model_path: str) -> tuple[dict, bool]:
    """(text section, tie_word_embeddings) of target.model_path's config.json (shapes.text_section)."""
    path = Path(model_path)
    if not path.is_dir():
        raise SpecError(f"target.model_path: model directory not found: {path}")
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise SpecError(f"target.model_path: no config.json in {path}") from None
    except (OSError, ValueError) as exc:
        raise SpecError(f"{path / 'config.json'}: {exc}") from None
    if not isinstance(config, dict):
        raise SpecError(f"{path / 'config.json'}: expected a JSON object")
    return shapes.text_section(config)


def target_fields_of(model_path: str) -> dict:
    """The target-derived fields of the drafter (shapes.target_fields) from the model's config.json."""
    text, tie = text_config_of(model_path)
    try:
        return shapes.target_fields(text, tie)
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecError(
            f"{model_path}/config.json: no usable {exc} (a decoder config of the Llama family "
            "is needed: hidden_size, num_hidden_layers, num_attention_heads, ...)"
        ) from None


def domino_head(emb_dim: int, gru_dim: int, width: int) -> dict:
    """The Domino head's size: as set, or (0) SpecForge's 256 and 1024, made smaller for a drafter narrower
    than 512 (the CPU demo's width 128 gets 64 and 256): there the full-size head would be several times
    the drafter it corrects."""
    return {"domino_emb_dim": emb_dim or min(256, width // 2), "domino_gru_dim": gru_dim or min(1024, 2 * width)}


def drafter_shape(
    cfg: Config, base: dict, mask_token_id: int | None = None, target: str = ""
) -> shapes.DrafterModelConfig:
    """base (a target's fields, or the synthetic ones) + the drafter/target sections + drafter.overrides,
    the captured layers resolved by services/run/layers.py's rule. mask_token_id: default drafter.mask_token_id;
    target: the model folder a layer error names."""
    values = dict(base)
    values.update(
        num_hidden_layers=cfg.drafter.num_layers,
        block_size=cfg.drafter.block_size,
        mask_token_id=cfg.drafter.mask_token_id if mask_token_id is None else mask_token_id,
        layer_types=list(cfg.drafter.layer_types),
        sliding_window=cfg.drafter.sliding_window or None,
    )
    if cfg.drafter.objective == "domino":
        values.update(domino_head(cfg.drafter.domino_emb_dim, cfg.drafter.domino_gru_dim, values["hidden_size"]))
    if cfg.target.layer_ids:
        values["target_layer_ids"] = list(cfg.target.layer_ids)
    for key, value in cfg.drafter.overrides.items():
        if key not in shapes.MODEL_FIELDS:
            raise SpecError(
                f"drafter.overrides.{key}: not a drafter model field (known: {', '.join(sorted(shapes.MODEL_FIELDS))})"
            )
        values[key] = value
    requested = list(values.get("target_layer_ids") or [])
    if not ascending(requested):
        raise SpecError(layer_ids_message("target.layer_ids", requested))
    try:
        values["target_layer_ids"] = layers.resolve_layer_ids(
            requested, values["num_target_layers"], values["num_hidden_layers"]
        )
    except ValueError as exc:
        raise SpecError(f"target.model_path {target}: {exc}" if target else str(exc)) from None
    try:
        m = shapes.DrafterModelConfig(**values)
    except ValueError as exc:  # the attention layout (check_layout), after drafter.overrides
        raise SpecError(f"drafter model config: {exc}") from None
    for ok, message in (
        (
            m.num_attention_heads % m.num_key_value_heads == 0,
            f"num_attention_heads={m.num_attention_heads} is "
            f"not a multiple of num_key_value_heads={m.num_key_value_heads}",
        ),
        (m.head_dim % 2 == 0, f"head_dim={m.head_dim} must be even for RoPE"),
        (
            m.domino == (cfg.drafter.objective == "domino") and (m.domino_emb_dim > 0) == m.domino,
            f"drafter.overrides: domino_emb_dim={m.domino_emb_dim}, domino_gru_dim={m.domino_gru_dim} do not fit "
            f"drafter.objective={cfg.drafter.objective!r} (set the Domino head's size with drafter.domino_emb_dim "
            "and drafter.domino_gru_dim)",
        ),
    ):
        if not ok:
            raise SpecError(message)
    check_sizes(cfg)
    return m


def check_sizes(cfg: Config) -> None:
    """What a row of data.pack_len tokens holds of the drafter: its anchors and its block (after
    drafter.overrides). drafter_shape and the launcher's preflight both check here."""
    block_size = cfg.drafter.overrides.get("block_size", cfg.drafter.block_size)
    if cfg.drafter.num_anchors > cfg.data.pack_len:
        raise SpecError(
            f"drafter.num_anchors={cfg.drafter.num_anchors} is larger than data.pack_len={cfg.data.pack_len}: "
            "a row of pack_len tokens holds at most pack_len anchors; lower drafter.num_anchors"
        )
    if block_size > cfg.data.pack_len:
        raise SpecError(f"drafter.block_size={block_size} is larger than data.pack_len={cfg.data.pack_len}")


# --- the spec --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    model_path: str  # "" for a synthetic drafter (no target)
    target: shapes.CaptureShape  # what the target captures
    drafter: dict  # shapes.DrafterModelConfig fields
    held_out: HeldOut
    batch_keys: dict  # dotted key -> {"decides": mark, "value": value}
    config: dict  # the resolved config it was resolved from
    origin: str = field(default="resolved from this worker's config", compare=False)

    @property
    def seq_len(self) -> int:
        return self.config["data"]["pack_len"]

    @property
    def block_size(self) -> int:
        return self.drafter["block_size"]

    @property
    def config_digest(self) -> str:
        return handshake_digest(self.batch_keys)

    def model(self) -> shapes.DrafterModelConfig:
        return shapes.DrafterModelConfig(**self.drafter)

    def target_config(self, cfg: Config) -> TargetConfig:
        """cfg.target capturing the spec's layers: what services.target.model.model.load_target loads."""
        return dataclasses.replace(cfg.target, layer_ids=list(self.target.layer_ids))

    def expected_of_target(self) -> dict:
        """What a target of this run must say in its handshake (handshake.TargetInfo.check)."""
        t = self.target
        return dict(
            num_layers=t.num_layers,
            hidden_size=t.hidden_size,
            vocab_size=t.vocab_size,
            layer_ids=list(t.layer_ids),
            seq_len=self.seq_len,
            labels_from_target=self.config["target"]["labels_from_target"],
            config_digest=self.config_digest,
        )

    def check_target(self, found: dict, what: str) -> None:
        """SpecError naming each field of `found` (num_layers, hidden_size, ...) that is not the spec's."""
        wrong = [
            f"{k}={v!r}, the run spec says {getattr(self.target, k)!r}"
            for k, v in found.items()
            if v != getattr(self.target, k)
        ]
        if wrong:
            raise SpecError(f"{what} " + "; ".join(wrong) + f" (run spec: {self.origin})")

    def check_loaded(self, loaded: shapes.CaptureShape) -> None:
        """The handshake's first half: what the target worker loaded against the spec."""
        self.check_target(
            {k: getattr(loaded, k) for k in ("num_layers", "hidden_size", "vocab_size", "layer_ids")},
            f"the target loaded from {self.model_path} has",
        )

    def to_dict(self) -> dict:
        t = self.target
        return {
            "format": FORMAT,
            "model_path": self.model_path,
            "target": {
                "num_layers": t.num_layers,
                "hidden_size": t.hidden_size,
                "vocab_size": t.vocab_size,
                "layer_ids": list(t.layer_ids),
                "hidden_width": t.hidden_width,
            },
            "drafter": self.drafter,
            "held_out": dataclasses.asdict(self.held_out),
            "batch_keys": self.batch_keys,
            "config_digest": self.config_digest,
            "config": self.config,
        }

    def save(self, run_dir: str | Path) -> Path:
        path = Path(run_dir) / FILE
        write_json_atomic(path, self.to_dict())
        return path


def resolve(cfg: Config, synthetic: bool = False) -> RunSpec:
    """The run's spec from cfg and target.model_path's config.json. synthetic: a drafter without a
    target (--synthetic) gets shapes.SYNTHETIC_MODEL's made-up one when target.model_path is empty."""
    path = cfg.target.model_path
    if path:
        base = target_fields_of(path)
    elif synthetic:
        base = dict(shapes.SYNTHETIC_MODEL)
    else:
        raise SpecError("target.model_path is not set (use --synthetic for a drafter without a target)")
    m = drafter_shape(cfg, base, target=path)
    if not path:  # the made-up target: the drafter's widths, no tokenizer (the last id masks)
        base = m.to_dict()
        if m.mask_token_id < 0:
            m = dataclasses.replace(m, mask_token_id=m.vocab_size - 1)
    target = shapes.CaptureShape(
        layer_ids=list(m.target_layer_ids),
        hidden_size=base["hidden_size"],
        vocab_size=base["vocab_size"],
        num_layers=base["num_target_layers"],
    )
    need = cfg.data.pack_len * target.hidden_width * shapes.HIDDEN_BYTES  # a bigger batch is dropped by every drafter
    if need > cfg.transport.max_batch_bytes:
        raise SpecError(
            f"transport.max_batch_bytes={cfg.transport.max_batch_bytes} is smaller than one batch's "
            f"hidden states ({need} bytes: data.pack_len={cfg.data.pack_len} x {len(target.layer_ids)} "
            f"layers x hidden_size {target.hidden_size} x {shapes.HIDDEN_BYTES} bytes); raise "
            "transport.max_batch_bytes or lower data.pack_len"
        )
    return RunSpec(
        model_path=path,
        target=target,
        drafter=m.to_dict(),
        held_out=HeldOut.of(cfg),
        batch_keys=batch_keys_of(cfg),
        config=cfg.to_dict(),
    )


def load(path: str | Path) -> RunSpec:
    """A runspec.json; SpecError naming the file when it is not one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, this version reads {FORMAT}")
        t = data["target"]
        return RunSpec(
            model_path=data["model_path"],
            target=shapes.CaptureShape(
                layer_ids=list(t["layer_ids"]),
                hidden_size=t["hidden_size"],
                vocab_size=t["vocab_size"],
                num_layers=t["num_layers"],
            ),
            drafter=dict(data["drafter"]),
            held_out=HeldOut(**data["held_out"]),
            batch_keys=dict(data["batch_keys"]),
            config=dict(data["config"]),
            origin=str(path),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SpecError(
            f"{path}: not a run spec ({type(exc).__name__}: {exc}); `launcher up` writes it, "
            f"or remove it and the workers resolve it themselves"
        ) from None


def for_worker(cfg: Config, run_dir: str | Path, synthetic: bool = False) -> RunSpec:
    """<run_dir>/runspec.json when `launcher up` wrote one, checked against this worker's config and
    the model on this host; else resolve(cfg) here (a worker without a launcher: tests, systemd)."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        return resolve(cfg, synthetic)
    spec = load(path)
    if spec.config != cfg.to_dict():
        raise SpecError(
            f"{path} was resolved from another config than this worker's ({_differences(spec.config, cfg.to_dict())}); "
            f"start the worker with --config {Path(run_dir) / 'config.json'}"
        )
    if spec.model_path:
        found = target_fields_of(spec.model_path)
        spec.check_target(
            {
                "num_layers": found["num_target_layers"],
                "hidden_size": found["hidden_size"],
                "vocab_size": found["vocab_size"],
            },
            f"the model at {spec.model_path} (its config.json) has",
        )
    return spec


def _differences(then: dict, now: dict, most: int = 3) -> str:
    flat = lambda d: {f"{s}.{k}": v for s, keys in d.items() for k, v in keys.items()}  # noqa: E731
    a, b = flat(then), flat(now)
    keys = [k for k in dict.fromkeys([*a, *b]) if a.get(k) != b.get(k)]
    said = "; ".join(f"{k}: {a.get(k)!r} there, {b.get(k)!r} here" for k in keys[:most])
    return said + (f"; and {len(keys) - most} more" if len(keys) > most else "")
