"""The marks on the config keys (services/run/config/schema.py `setting`) and the checks derived from them."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from services.run import runspec, shapes
from services.run.checkpoint_compat import MODEL_FIELDS, NOT_FOR_RESUME, RUN_FIELDS, model_errors
from services.run.config import BATCH_KINDS, SECTIONS, load_config, section_class
from services.target.batches.packing import Packing, build_index, cache_key
from services.tools.demo import conversations
from tests.launching import run_launcher, target_argv

VOCAB = 4096
ALL_KEYS = [(s, f) for s in SECTIONS for f in dataclasses.fields(section_class(s))]


def test_every_config_key_says_what_it_decides_about_a_batch():
    """A key added without a mark fails here: mark it with setting(..., batch=KIND)."""
    unmarked = [f"{s}.{f.name}" for s, f in ALL_KEYS if f.metadata.get("batch") not in BATCH_KINDS]
    assert unmarked == []


def test_the_three_checks_come_from_the_marks():
    assert set(RUN_FIELDS) == set(runspec.keys_deciding(runspec.RESUME_KINDS))
    assert {"data.path", "data.pack_len", "run.seed", "optimizer.grad_accum", "target.labels_from_target"} <= set(
        RUN_FIELDS
    )
    assert "run.epochs" not in RUN_FIELDS  # more epochs later: batch g < N stays the same
    base = _digest(load_config(None, ['data.on_bad_sample="skip"']))
    for dotted in runspec.keys_deciding(runspec.HANDSHAKE_KINDS):
        changed = load_config(None, ['data.on_bad_sample="skip"', _changed(dotted)])
        assert _digest(changed) != base, dotted


def _digest(cfg) -> str:
    return runspec.handshake_digest(runspec.batch_keys_of(cfg))


def _changed(dotted: str) -> str:
    """An override that gives `dotted` another valid value."""
    section, key = dotted.split(".")
    default = getattr(getattr(load_config(None, []), section), key)
    special = {
        "data.on_bad_sample": '"fail"',
        "data.eval_fraction": "0.25",
        "target.layer_ids": "[1, 2]",
        "data.pack_len": "96",
        "data.max_doc_len": "40",
        "data.max_line_bytes": "200",
        "data.max_doc_tokens": "30",
        "data.chat_template_kwargs": "{enable_thinking = false}",
    }
    if dotted in special:
        return f"{dotted}={special[dotted]}"
    if isinstance(default, bool):
        return f"{dotted}={'false' if default else 'true'}"
    if isinstance(default, (int, float)):
        return f"{dotted}={default + 1}"
    if isinstance(default, str):
        return f'{dotted}="{default}x"'
    if isinstance(default, list):
        return f"{dotted}=[]" if default else f"{dotted}=[1]"
    return f"{dotted}={{}}"


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "chat.jsonl"
    lines = [json.dumps(c) for c in conversations(120, seed=3)]
    lines.insert(
        5,
        json.dumps(
            {"messages": [{"role": "user", "content": "x " * 400}, {"role": "assistant", "content": "y " * 400}]}
        ),
    )  # long: max_* bite
    path.write_text("\n".join(lines) + "\n")
    return path


def _packed(cfg, tokenizer):
    tensors, _ = build_index(Packing.from_config(cfg), tokenizer, VOCAB)
    return {k: np.asarray(v) for k, v in tensors.items()}


def test_the_resume_check_reads_every_model_field_but_the_named_ones():
    from services.run.shapes import MODEL_FIELDS as ALL
    from services.run.shapes import SYNTHETIC_MODEL, DrafterModelConfig

    assert set(MODEL_FIELDS) == set(ALL) - NOT_FOR_RESUME and NOT_FOR_RESUME < set(ALL)
    now = DrafterModelConfig(**SYNTHETIC_MODEL).to_dict()
    assert model_errors({"model": dict(now, initializer_range=0.5)}, now) == []
    assert model_errors({"model": dict(now, block_size=8)}, now) == ["model block_size: checkpoint 8, now 16"]
    # a checkpoint that recorded no layer_types (written before sliding-window layers) is not resumed
    older = {k: v for k, v in now.items() if k != "layer_types"}
    assert model_errors({"model": older}, now) == [f"model layer_types: checkpoint None, now {now['layer_types']!r}"]
    # one written before the Domino head existed had none: it resumes a plain run, not a Domino one
    before_domino = {k: v for k, v in now.items() if not k.startswith("domino_")}
    assert model_errors({"model": before_domino}, now) == []
    assert model_errors({"model": before_domino}, dict(now, domino_emb_dim=8, domino_gru_dim=12)) == [
        "model domino_emb_dim: checkpoint 0, now 8",
        "model domino_gru_dim: checkpoint 0, now 12",
    ]


def test_keys_not_marked_as_deciding_tokens_leave_the_packed_data_alone(data_file, tokenizer):
    """The marks are checked against what packing really does: every [run] / [data] / [target] key
    without a "content" or "path" mark is changed alone, and the packed rows must stay the same
    (and the cache key too); every key with one changes the cache key."""
    base_args = [f"data.path={data_file}", "data.pack_len=128", 'data.on_bad_sample="skip"']
    base_cfg = load_config(None, base_args)
    base, key = _packed(base_cfg, tokenizer), cache_key(Packing.from_config(base_cfg), tokenizer, VOCAB)
    for section, f in ALL_KEYS:
        dotted = f"{section}.{f.name}"
        if section not in ("run", "data", "target") or f.metadata["batch"] == "path" or dotted == "target.model_path":
            continue  # files: by content (tests/unit/test_data_packing.py)
        try:
            cfg = load_config(None, base_args + [_changed(dotted)])
        except Exception:
            continue  # a value this key refuses: nothing to compare
        if f.metadata["batch"] in runspec.CACHE_KINDS:
            assert cache_key(Packing.from_config(cfg), tokenizer, VOCAB) != key, dotted
            continue
        assert cache_key(Packing.from_config(cfg), tokenizer, VOCAB) == key, dotted
        other = _packed(cfg, tokenizer)
        assert other.keys() == base.keys() and all(np.array_equal(other[k], base[k]) for k in base), (
            f'{dotted} changes the packed data: mark it batch="content" in services/run/config/schema.py'
        )


# --- the run spec: resolved once, by the launcher or by a worker alike ------------------------------


def _tiny_target(path, tok_dir, layers: int = 8, hidden: int = 32, weights: bool = False):
    """A target folder: config.json and the tokenizer (and random weights when asked), made on the fly."""
    import shutil

    from transformers import Qwen3Config, Qwen3ForCausalLM

    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(tok_dir, path)
    config = Qwen3Config(
        vocab_size=640,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
    )
    (Qwen3ForCausalLM(config) if weights else config).save_pretrained(path)
    return path


def _config(model, data="", *more):
    return load_config(
        None,
        [
            f"target.model_path={json.dumps(str(model))}",
            f"data.path={json.dumps(str(data))}",
            "data.pack_len=256",
            "drafter.num_layers=3",
            "drafter.num_anchors=16",
            *more,
        ],
    )


@pytest.mark.processes
def test_launcher_up_writes_the_spec_a_worker_without_it_resolves_too(tmp_path, tok_dir):
    """`launcher up` writes runspec.json before any worker starts (here a bad data line stops it right
    after, before any worker); a worker in that run dir reads it, one started without a launcher (no
    runspec.json; a systemd unit from `launcher units`) resolves it with the same function: one answer."""
    from launcher.units import render_units
    from services.run.layers import default_layer_ids

    model = _tiny_target(tmp_path / "model", tok_dir, weights=True)  # `up` checks the weights are there
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps(conversations(1, seed=0)[0]) + "\n" + '{"messages": [\n')
    toml = tmp_path / "run.toml"
    toml.write_text(
        f'[target]\nmodel_path = "{model}"\n[data]\npath = "{data}"\npack_len = 256\neval_fraction = 0.5\n'
        "[drafter]\nnum_layers = 3\nnum_anchors = 16\n"
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()  # an existing folder is prepared in place: what `up` wrote stays
    out = run_launcher(
        "up",
        "--config",
        str(toml),
        "--device",
        "cpu",
        "--gpus",
        "0:target,1:drafter",
        "--run-dir",
        str(run_dir),
        timeout=120,
    )
    assert out.returncode == 2 and f"{data}:2: invalid JSON" in out.stderr, out.stderr
    assert not (run_dir / "run.json").exists()  # no worker was started
    assert [p.name for p in run_dir.iterdir() if "runspec" in p.name] == ["runspec.json"]  # no temp file left
    written = json.loads((run_dir / "runspec.json").read_text())
    assert written["target"] == {
        "num_layers": 8,
        "hidden_size": 32,
        "vocab_size": 640,
        "layer_ids": default_layer_ids(8, 3),
        "hidden_width": 3 * 32,
    }
    assert written["drafter"]["target_layer_ids"] == [1, 3, 5] and written["drafter"]["block_size"] == 16
    assert written["held_out"] == {"source": "data.eval_fraction", "path": str(data), "fraction": 0.5, "seed": 0}
    assert written["batch_keys"]["data.pack_len"] == {"decides": "content", "value": 256}
    assert set(written["batch_keys"]) == set(runspec.keys_deciding(runspec.DECIDING))
    cfg = load_config(run_dir / "config.json")
    assert written["config_digest"] == _digest(cfg)
    assert runspec.for_worker(cfg, run_dir).to_dict() == written  # read from the file
    assert runspec.for_worker(cfg, tmp_path / "no-launcher").to_dict() == written  # resolved by the worker
    render_units("0:target,1:drafter", str(toml), str(tmp_path / "units"), str(tmp_path / "srv"), device="cpu")
    under_systemd = load_config(tmp_path / "units" / "dflash-env" / "config.json")
    assert runspec.for_worker(under_systemd, tmp_path / "srv").to_dict() == written


def test_a_spec_from_another_config_or_another_model_is_refused_naming_the_field(tmp_path, tok_dir):
    model = _tiny_target(tmp_path / "model", tok_dir)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    runspec.resolve(_config(model)).save(run_dir)
    with pytest.raises(
        runspec.SpecError,
        match=r"resolved from another config than this worker's \(data.pack_len: "
        r"256 there, 128 here\)",
    ):
        runspec.for_worker(_config(model, "", "data.pack_len=128"), run_dir)
    _tiny_target(model, tok_dir, layers=6, hidden=48)  # the folder now holds another model
    with pytest.raises(runspec.SpecError) as err:
        runspec.for_worker(_config(model), run_dir)
    assert str(err.value) == (
        f"the model at {model} (its config.json) has num_layers=6, the run spec says 8; "
        f"hidden_size=48, the run spec says 32 (run spec: {run_dir / 'runspec.json'})"
    )
    (run_dir / "runspec.json").write_text("{}")
    with pytest.raises(runspec.SpecError, match="runspec.json: not a run spec"):
        runspec.for_worker(_config(model), run_dir)


def test_what_a_target_loaded_is_compared_with_the_spec(tmp_path, tok_dir):
    """The handshake is a comparison with the spec: in the target worker, of the model it loaded
    (a real HF model here); in the drafter, of what its target says it loaded."""
    from services.net.handshake import HandshakeError, TargetInfo
    from services.target.model.model import load_target

    model = _tiny_target(tmp_path / "model", tok_dir, weights=True)
    cfg = _config(model, "", 'target.dtype="float32"')
    spec = runspec.resolve(cfg)
    same = load_target(spec.target_config(cfg), "cpu")
    spec.check_loaded(same.info)
    assert same.info == spec.target and same.info.hidden_width == spec.model().hidden_width == 96
    _tiny_target(model, tok_dir, layers=6, hidden=48, weights=True)  # replaced after the spec was made
    other = load_target(spec.target_config(cfg), "cpu")
    with pytest.raises(
        runspec.SpecError,
        match=f"the target loaded from {model} has num_layers=6, the run spec says "
        "8; hidden_size=48, the run spec says 32",
    ):
        spec.check_loaded(other.info)
    said = TargetInfo.of(
        other.info,
        num_batches=4,
        num_eval_batches=1,
        seq_len=256,
        mask_token_id=-1,
        labels_from_target=True,
        config_digest=spec.config_digest,
        model_path=str(model),
        capture_path="packed",
        bad_samples=0,
    )
    TargetInfo.of(same.info, **{k: v for k, v in vars(said).items() if k not in vars(same.info)}).check(
        **spec.expected_of_target()
    )
    with pytest.raises(
        HandshakeError, match="disagree on num_layers: target 6, drafter 8; hidden_size: target 48, drafter 32"
    ):
        TargetInfo.from_wire(said.to_wire()).check(**spec.expected_of_target())


def test_config_json_is_read_as_transformers_reads_it(tmp_path):
    """The spec reads config.json without transformers (the launcher never imports torch); the
    fields it takes are the ones transformers' own config gives, for dense, composite and hybrid targets."""
    from transformers import AutoConfig, Qwen3Config, Qwen3VLConfig

    from bench.shapes import checkpoint_config
    from tests.drafters import model_config_from_hf

    small = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rope_theta=50000.0,
    )
    configs = {
        "tied": Qwen3Config(**small, tie_word_embeddings=True),
        "untied": Qwen3Config(**small),
        "composite": Qwen3VLConfig(text_config=dict(small)),
        "8b": checkpoint_config("8b"),
        "27b-hybrid": checkpoint_config("27b-hybrid"),
    }
    for name, config in configs.items():
        config.save_pretrained(tmp_path / name)
        full = AutoConfig.from_pretrained(tmp_path / name)
        text = full.get_text_config(decoder=True)
        tie = bool(getattr(full, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))
        assert runspec.target_fields_of(str(tmp_path / name)) == model_config_from_hf(text, tie), name


def test_a_synthetic_drafter_gets_the_made_up_target_and_the_same_shape_as_before():
    from services.run.shapes import SYNTHETIC_MODEL
    from tests.drafters import build_model_config

    cfg = load_config(None, ["drafter.overrides={hidden_size=48}", "drafter.num_layers=2"])
    spec = runspec.resolve(cfg, synthetic=True)
    assert spec.model() == build_model_config(cfg, SYNTHETIC_MODEL, mask_token_id=SYNTHETIC_MODEL["vocab_size"] - 1)
    assert (spec.target.hidden_size, spec.target.vocab_size, spec.target.num_layers) == (48, 128, 8)
    assert spec.target.layer_ids == spec.model().target_layer_ids and spec.target.hidden_width == 2 * 48
    with pytest.raises(runspec.SpecError, match="target.model_path is not set"):
        runspec.resolve(cfg)


def test_the_block_size_is_the_drafters_everywhere(tmp_path, tok_dir):
    """drafter.overrides may set the model's block size: the target's verify limits take the spec's."""
    from services.target.verify.verifying import VerifySettings

    model = _tiny_target(tmp_path / "model", tok_dir)
    cfg = _config(model, "", "drafter.overrides={block_size=4}")
    spec = runspec.resolve(cfg)
    assert spec.block_size == spec.model().block_size == VerifySettings.from_config(cfg, spec).limits.max_block == 4


def test_the_held_out_split_is_the_specs(data_file, tokenizer, tmp_path):
    """The packed eval split and the eval's prompts are the lines HeldOut.lines picks, by line
    number: a bad line (here the file's first, blank lines around it) moves no other line."""
    from services.data.data_lines import heldout_lines, nonblank_lines
    from services.target.batches.data import BadSamples, read_documents

    good = data_file.read_text().splitlines()
    path = tmp_path / "with-bad.jsonl"
    path.write_text("not json\n\n" + "\n".join(good) + "\n")
    cfg = load_config(
        None, [f"data.path={path}", "data.pack_len=4096", "data.eval_fraction=0.1", 'data.on_bad_sample="skip"']
    )
    held_out = runspec.HeldOut.of(cfg)
    assert runspec.HeldOut(**json.loads(json.dumps(dataclasses.asdict(held_out)))) == held_out
    numbers = [n for n, _ in nonblank_lines(path)]
    assert numbers == [1] + list(range(3, len(good) + 3))  # the blank line 2 is no line of the split
    chosen = held_out.lines(numbers)
    docs = {d.line: d for d in read_documents(str(path), tokenizer, VOCAB, "skip", BadSamples())}
    tensors, meta = build_index(Packing.from_config(cfg), tokenizer, VOCAB)
    assert meta["bad_samples"] == "1"
    assert int(meta["eval_samples"]) == len(chosen - {1}) == sum(1 for n in chosen if n in docs) > 3
    expected = [path.read_text().splitlines()[n - 1] for n in sorted(chosen - {1})]
    assert [line.rstrip("\n") for line in heldout_lines(held_out, cfg.data)] == expected
    if 1 in chosen:  # the bad line was drawn: it holds nothing
        assert len(chosen - {1}) == len(chosen) - 1


@pytest.mark.processes
def test_a_target_worker_on_another_model_than_the_spec_stops_with_one_line(tmp_path, tok_dir):
    """A real target worker in a run dir whose runspec.json was resolved for another model (the
    folder was replaced since `launcher up`): exit 2 before loading weights, one line naming the field."""
    import subprocess

    from services.run.config import dump_json

    model = _tiny_target(tmp_path / "model", tok_dir)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = _config(model, tmp_path / "chat.jsonl")
    dump_json(cfg, run_dir / "config.json")
    runspec.resolve(cfg).save(run_dir)
    _tiny_target(model, tok_dir, layers=6, weights=True)
    out = subprocess.run(
        target_argv(run_dir, "--config", run_dir / "config.json"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    (line,) = [line for line in out.stderr.splitlines() if " error " in line]
    assert line.endswith(
        f"config error: the model at {model} (its config.json) has num_layers=6, the run spec "
        f"says 8 (run spec: {run_dir / 'runspec.json'})"
    )
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "layout",
    [
        dict(),  # every layer full attention, the released drafters' layout
        dict(
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=64,
            initializer_range=0.01,
            tie_word_embeddings=True,
            mask_token_id=7,
        ),
    ],
)
def test_the_drafter_shape_is_its_export_config_and_back(layout):
    """One shape: an export's config.json (to_hf) reads back as the same DrafterModelConfig (from_hf), the
    launcher eval of an export builds the drafter that was trained."""
    m = shapes.DrafterModelConfig(
        **{**shapes.SYNTHETIC_MODEL, "target_layer_ids": [1, 4, 6], "block_size": 8, **layout}
    )
    conf = json.loads(json.dumps(m.to_hf("bfloat16")))
    assert shapes.DrafterModelConfig.from_hf(conf) == m
    assert conf["use_sliding_window"] is ("sliding_window" in layout) and conf["architectures"] == [shapes.ARCHITECTURE]
    released = {k: v for k, v in conf.items() if k not in ("layer_types", "sliding_window", "initializer_range")}
    assert shapes.DrafterModelConfig.from_hf(released).layer_types == ["full_attention"] * m.num_hidden_layers
    with pytest.raises(KeyError, match="num_target_layers"):
        shapes.DrafterModelConfig.from_hf({k: v for k, v in conf.items() if k != "num_target_layers"})
