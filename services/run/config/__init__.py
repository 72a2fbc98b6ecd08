"""Run configuration: one TOML file, eleven sections (the dataclasses of `Config`), dotted CLI overrides.

Three parts, each the one home of its names:

    schema.py    the sections and their keys: defaults, what each key decides about batch g, the choices
    loading.py   a TOML file or a run's config.json, overrides, the renamed keys (RENAMED), dump_json
    checks.py    what a type cannot say, one function per section; validate() runs them all

Callers import from here (`from services.run.config import Config, load_config`): this package
re-exports the names other modules use, and defines none. No torch: the launcher uses it.
"""

from services.run.config.checks import (
    ascending,
    check_layout,
    is_loopback,
    layer_ids_message,
    plaintext_hosts,
    validate,
)
from services.run.config.loading import (
    RENAMED,
    dump_json,
    from_dict,
    load_config,
    old_names_used,
    parse_override,
    parse_value,
    toml_literal,
    upgrade,
)
from services.run.config.schema import (
    BATCH_KINDS,
    DRAFTER_PRECISIONS,
    FP8_DECODE_GEMMS,
    FULL,
    OBJECTIVES,
    POSITION_WEIGHTS,
    SECTIONS,
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
    LogConfig,
    OptimizerConfig,
    RunConfig,
    SuperviseConfig,
    TargetConfig,
    TransportConfig,
    section_class,
    setting,
    value_of,
)

__all__ = [
    "BATCH_KINDS",
    "DRAFTER_PRECISIONS",
    "FP8_DECODE_GEMMS",
    "FULL",
    "OBJECTIVES",
    "POSITION_WEIGHTS",
    "RENAMED",
    "SECTIONS",
    "SLIDING",
    "TARGET_COMPILE",
    "TARGET_DTYPES",
    "TARGET_QUANTIZE",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DrafterConfig",
    "EvalConfig",
    "KernelsConfig",
    "LogConfig",
    "OptimizerConfig",
    "RunConfig",
    "SuperviseConfig",
    "TargetConfig",
    "TransportConfig",
    "ascending",
    "check_layout",
    "dump_json",
    "from_dict",
    "is_loopback",
    "layer_ids_message",
    "load_config",
    "old_names_used",
    "parse_override",
    "parse_value",
    "plaintext_hosts",
    "section_class",
    "setting",
    "toml_literal",
    "upgrade",
    "validate",
    "value_of",
]
