"""The target's info and the drafter's check of it (services/net/handshake.py)."""

import pytest

from services.net.handshake import CaptureShape, HandshakeError, TargetInfo
from services.net.wire import WireError
from services.run import runspec
from services.run.config import load_config


def _info(**changes) -> TargetInfo:
    values = dict(
        num_batches=10,
        num_eval_batches=2,
        seq_len=256,
        hidden_size=64,
        layer_ids=[1, 3],
        vocab_size=160,
        mask_token_id=-1,
        labels_from_target=False,
        config_digest="abc",
        model_path="/m",
        capture_path="packed",
        bad_samples=0,
    )
    return TargetInfo(**{**values, **changes})


def test_the_wire_form_round_trips_and_every_field_is_typed():
    info = _info()
    wire = info.to_wire()
    assert wire["hidden_width"] == 128 and TargetInfo.from_wire(wire) == info
    with pytest.raises(WireError, match="info field 'seq_len': expected int, got '256'"):
        TargetInfo.from_wire({**wire, "seq_len": "256"})
    with pytest.raises(WireError, match="info field 'layer_ids'"):
        TargetInfo.from_wire({**wire, "layer_ids": [1, True]})
    with pytest.raises(WireError, match="info field 'labels_from_target'"):
        TargetInfo.from_wire({**wire, "labels_from_target": 1})
    with pytest.raises(WireError, match="expected a map"):
        TargetInfo.from_wire([1, 2])


def test_the_info_is_built_from_what_the_target_captures():
    shape = CaptureShape(layer_ids=[0, 2, 5], hidden_size=48, vocab_size=99, num_layers=6)
    info = _info(hidden_size=1, layer_ids=[0], vocab_size=1)
    built = TargetInfo.of(
        shape, **{k: v for k, v in vars(info).items() if k not in ("hidden_size", "layer_ids", "vocab_size")}
    )
    assert (built.layer_ids, built.hidden_size, built.vocab_size) == ([0, 2, 5], 48, 99)
    assert built.hidden_width == shape.hidden_width == 3 * 48 and built.to_wire()["hidden_width"] == 144


def test_check_names_every_disagreement_with_both_values():
    mine = dict(
        hidden_size=64, vocab_size=160, layer_ids=[1, 3], seq_len=256, labels_from_target=False, config_digest="abc"
    )
    _info().check(**mine)
    with pytest.raises(HandshakeError) as err:
        _info().check(**{**mine, "layer_ids": [1, 2], "vocab_size": 200})
    assert "layer_ids: target [1, 3], drafter [1, 2]" in str(err.value)
    assert "vocab_size: target 160, drafter 200" in str(err.value) and "seq_len" not in str(err.value)


def _digest(cfg) -> str:
    return runspec.handshake_digest(runspec.batch_keys_of(cfg))


def test_the_digest_follows_what_a_batch_holds_and_nothing_else():
    base = _digest(load_config(None, []))
    assert _digest(load_config(None, ["data.pack_len=4096"])) != base
    assert _digest(load_config(None, ["run.seed=1"])) != base
    assert _digest(load_config(None, ["optimizer.lr=1e-3", "log.every=5"])) == base
    assert _digest(load_config(None, ['data.path="/mnt/b/chat.jsonl"'])) == base  # hosts mount apart
