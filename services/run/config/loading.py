"""Loading a config: a TOML file (or the resolved JSON the launcher writes, dump_json), dotted
overrides (`drafter.lr=3e-4`), the keys renamed since (RENAMED, upgrade: an old file still reads),
each key's type checked against the schema; then the checks (checks.validate).
"""

from __future__ import annotations

import json
import re
import sys
import typing
from pathlib import Path

from services.run.config.checks import validate
from services.run.config.schema import SECTIONS, Config, ConfigError, section_class

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


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
    hints = _hints(section_class(section))
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


def dump_json(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True))
