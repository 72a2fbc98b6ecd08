import dataclasses
import json
import re

import pytest

from services.run.config import Config, ConfigError, dump_json, load_config, parse_value, section_class, toml_literal
from tests.launching import REPO
from tests.old_configs import before_the_split


def describe_defaults() -> dict[str, str]:
    """Every key with its default as JSON ("section.key" -> "8192"): what docs/config.md lists."""
    return {
        f"{f.name}.{key}": json.dumps(value)
        for f in dataclasses.fields(Config)
        for key, value in dataclasses.asdict(section_class(f.name)()).items()
    }


def write(tmp_path, text, name="run.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_and_overrides(tmp_path):
    path = write(tmp_path, "[drafter]\nlr = 1e-3\nnum_layers = 2\n[target]\nlayer_ids = [1, 3]\n")
    cfg = load_config(path, ["optimizer.lr=3e-4", "data.pack_len=1024", "target.model_path=/models/x"])
    assert cfg.optimizer.lr == 3e-4  # override wins over the file
    assert cfg.drafter.num_layers == 2  # file wins over the default
    assert cfg.target.layer_ids == [1, 3]
    assert cfg.data.pack_len == 1024
    assert cfg.target.model_path == "/models/x"  # bare words are strings
    assert cfg.drafter.block_size == Config().drafter.block_size


def test_int_is_accepted_for_float(tmp_path):
    cfg = load_config(write(tmp_path, "[drafter]\nlr = 1\n"))
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[drafter]\nlrr = 1.0\n", "drafter.lrr"),
        ("[nope]\nx = 1\n", "[nope]"),
        ('[drafter]\nnum_layers = "five"\n', "drafter.num_layers"),
        ('[target]\nlayer_ids = [1, "a"]\n', "target.layer_ids[1]"),
        ('[data]\non_bad_sample = "ignore"\n', "data.on_bad_sample"),
        ("[drafter\n", "run.toml"),
    ],
)
def test_bad_files_name_the_key_and_file(tmp_path, text, needle):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert needle in str(err.value)
    if needle.startswith(("drafter", "[nope]", "target")):
        assert str(path) in str(err.value)


@pytest.mark.parametrize(
    "override, needle",
    [
        ("optimizer.lr", "section.key=value"),
        ("lr=1", "section.key=value"),
        ("bogus.lr=1", "[bogus]"),
        ("kernels.compile=3", "kernels.compile"),
        ("target.compile=sometimes", "target.compile must be one of auto, on, off, got 'sometimes'"),
        ("target.compile=true", "target.compile: expected str, got bool True"),
        ("target.quantize=int4", "target.quantize must be one of none, fp8, got 'int4'"),
    ],
)
def test_bad_overrides(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert needle in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.toml")


def test_resolved_json_round_trip(tmp_path):
    cfg = load_config(None, ["drafter.num_anchors=64", "target.layer_ids=[2]"])
    dump_json(cfg, tmp_path / "config.json")
    again = load_config(tmp_path / "config.json")
    assert again == cfg
    assert json.loads((tmp_path / "config.json").read_text())["drafter"]["num_anchors"] == 64


def test_docs_describe_every_key_with_its_default():
    docs = (REPO / "docs" / "config.md").read_text()
    rows = {}
    for line in docs.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]  # a \| stays in its cell
        if len(cells) == 3 and cells[0].startswith("`") and "." in cells[0]:
            rows[cells[0].strip("`")] = (cells[1].strip("`"), cells[2])
    expected = describe_defaults()
    assert set(rows) == set(expected), (
        f"docs/config.md: missing {set(expected) - set(rows)}, unknown {set(rows) - set(expected)}"
    )
    for key, (default, meaning) in rows.items():
        assert default == expected[key], f"docs/config.md: {key} default {default}, the code says {expected[key]}"
        assert len(meaning) > 10, f"docs/config.md: {key} has no description"


def test_layer_ids_must_ascend_in_the_config_and_in_drafter_overrides():
    from services.drafter.training.synthetic import SYNTHETIC_MODEL
    from tests.drafters import build_model_config

    assert load_config(None, ["target.layer_ids=[0, 2, 5]"]).target.layer_ids == [0, 2, 5]
    for ids in ("[2, 0]", "[3, 3]"):
        with pytest.raises(ConfigError, match=r"target.layer_ids \[\d, \d\] must be in ascending order"):
            load_config(None, [f"target.layer_ids={ids}"])
    cfg = load_config(None, ["drafter.num_layers=2"])
    cfg.drafter.overrides = {"target_layer_ids": [5, 1]}  # the model config's own route to the ids
    with pytest.raises(ConfigError, match=r"target.layer_ids \[5, 1\] must be in ascending order"):
        build_model_config(cfg, SYNTHETIC_MODEL, mask_token_id=1)


def test_toml_literal_is_what_an_override_and_a_config_file_read_back():
    """The advice lines print values as TOML (data.chat_template_kwargs = {enable_thinking = false})."""
    for value in (
        {},
        {"enable_thinking": False},
        {"a b": 'say "hi"', "n": 3, "x": 0.5, "l": [1, "z"], "d": {"q": True}},
    ):
        literal = toml_literal(value)
        assert parse_value(literal) == value
        assert load_config(None, [f"data.chat_template_kwargs={literal}"]).data.chat_template_kwargs == value
    assert toml_literal({"enable_thinking": False}) == "{enable_thinking = false}"
    assert parse_value("false") is False and parse_value("hello") == "hello"  # bare words stay strings


def test_a_placement_names_a_rank_outside_its_role():
    from pathlib import Path

    from services.run.placement import Placement

    with pytest.raises(ValueError, match=r"drafter rank 2 is not in \[0, 2\)"):
        Placement("run", "drafter", rank=2, world_size=2)
    at = Placement("run", "drafter", rank=1, world_size=2, num_targets=3)
    assert at.run_dir == Path("run") and (at.rank, at.world_size, at.num_targets) == (1, 2, 3)


# a valid value, other than the default, for every key that was renamed
RENAMED_SAMPLES = {
    "log.every": 5,
    "log.wandb_project": "proj",
    "checkpoint.every": 7,
    "checkpoint.keep": 2,
    "checkpoint.export_at_end": False,
    "eval.every": 3,
    "eval.num_prompts": 4,
    "eval.prompts": ["a.jsonl"],
    "eval.max_new_tokens": 9,
    "eval.budget_s": 12.5,
    "eval.target_share": 0.5,
    "eval.sessions": 2,
    "supervise.stall_after_s": 30.0,
    "supervise.startup_stall_after_s": 99.0,
    "supervise.unresponsive_after_s": 11.0,
    "supervise.stop_timeout_s": 20.0,
    "supervise.max_restarts": 1,
    "supervise.rendezvous_timeout_s": 50.0,
    "optimizer.lr": 1e-3,
    "optimizer.min_lr_ratio": 0.1,
    "optimizer.warmup_ratio": 0.2,
    "optimizer.weight_decay": 0.01,
    "optimizer.grad_clip": 0.5,
    "optimizer.max_nonfinite_steps": 3,
    "optimizer.grad_accum": 2,
    "kernels.attention": "dense",
    "kernels.compile": False,
    "kernels.loss_chunk": 512,
    "kernels.precision": "fp8",
}


def test_every_renamed_key_reads_under_its_old_name_in_a_file_an_override_and_an_older_runs_config(tmp_path):
    """RENAMED: [run] and [drafter] split into a section per component. Each old key, in a TOML table,
    as a dotted override and in the config.json of a run from before the split, lands at its new key;
    that old config.json resumes (no key deciding batch g differs); one key under both names is refused."""
    from services.run.checkpoint_compat import run_errors
    from services.run.config import RENAMED, value_of

    assert set(RENAMED_SAMPLES) == set(RENAMED.values())
    defaults = Config()
    for old, new in RENAMED.items():
        value = RENAMED_SAMPLES[new]
        assert value != value_of(defaults, new), new
        section, key = old.split(".")
        toml = write(tmp_path, f"[{section}]\n{key} = {toml_literal(value)}\n")
        assert value_of(load_config(toml), new) == value, old
        assert value_of(load_config(None, [f"{old}={toml_literal(value)}"]), new) == value, old
    # an older run's config.json: every renamed key under its old section, with the samples
    now = load_config(None, [f"{new}={toml_literal(v)}" for new, v in RENAMED_SAMPLES.items()])
    old_layout = before_the_split(now.to_dict())
    assert set(old_layout) == {"run", "target", "data", "drafter", "transport"}
    (tmp_path / "config.json").write_text(json.dumps(old_layout))
    assert load_config(tmp_path / "config.json") == now
    assert run_errors(old_layout, now.to_dict()) == []  # it resumes: grad_accum (a schedule key) read at its place
    assert run_errors({**old_layout, "drafter": {**old_layout["drafter"], "grad_accum": 9}}, now.to_dict()) == [
        "optimizer.grad_accum: checkpoint 9, now 2"
    ]
    dump_json(now, tmp_path / "new.json")
    assert load_config(tmp_path / "new.json") == now
    with pytest.raises(ConfigError, match="run.checkpoint_every and checkpoint.every are the same key"):
        load_config(write(tmp_path, "[run]\ncheckpoint_every = 3\n[checkpoint]\nevery = 4\n"))


def test_a_config_file_that_is_not_text_is_named(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_bytes(b"\xf0\x9f\x00garbage")
    with pytest.raises(ConfigError, match=r"config.json: not UTF-8 text \(byte 0 is 0xf0\)"):
        load_config(bad)
