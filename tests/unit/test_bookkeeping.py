"""What runs only inside the drafter process, tested on its own: the metrics window and the
jsonl truncation a resume relies on."""

import json

import pytest

from services.drafter.books.ledger import truncate_jsonl
from services.drafter.books.metrics import MetricsWindow


def _step(loss, tau, blocks, supervised=10, reachable=9, sampled=5, per_position=(1.0, 0.5)):
    return dict(
        loss=loss,
        accuracy=0.5,
        tau=tau,
        trained_blocks=blocks,
        supervised=supervised,
        reachable=reachable,
        sampled=sampled,
        accuracy_per_position=list(per_position),
        step=7,
        lr=1e-3,
    )


def test_the_window_weights_every_batch_by_its_blocks_and_sums_the_counts():
    window = MetricsWindow()
    window.add(_step(loss=4.0, tau=2.0, blocks=10, per_position=(1.0, 0.0)))
    window.add(_step(loss=1.0, tau=5.0, blocks=30, per_position=(0.0, 1.0)))
    last = _step(loss=1.0, tau=5.0, blocks=30)
    mean = window.mean(last)
    assert mean["loss"] == pytest.approx((4.0 * 10 + 1.0 * 30) / 40) and mean["tau"] == pytest.approx(4.25)
    assert mean["trained_blocks"] == 40 and mean["accuracy_per_position"] == pytest.approx([0.25, 0.75])
    assert (mean["supervised"], mean["reachable"], mean["sampled"]) == (20, 18, 10)
    assert mean["step"] == 7 and mean["lr"] == 1e-3  # the rest is the last step's


def test_an_empty_window_gives_back_the_last_step():
    window = MetricsWindow()
    window.add(_step(loss=2.0, tau=1.0, blocks=0, supervised=0, reachable=0, sampled=0))
    last = _step(loss=2.0, tau=1.0, blocks=0, supervised=0, reachable=0, sampled=0)
    assert window.mean(last) == last


def test_truncate_keeps_the_lineage_up_to_a_step_and_drops_a_line_cut_by_a_crash(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 6)]
    path.write_text("\n".join(lines) + "\n" + '{"step": 6, "lo')  # the last write was cut short
    truncate_jsonl(path, keep_through_step=3)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    truncate_jsonl(path, keep_through_step=10)  # nothing past the end: unchanged
    assert len(path.read_text().splitlines()) == 3
    truncate_jsonl(tmp_path / "missing.jsonl", 3)  # nothing to truncate: no file made
    assert not (tmp_path / "missing.jsonl").exists()


def test_a_resume_on_fewer_drafters_cuts_the_ledger_of_the_ranks_it_no_longer_has(tmp_path):
    from services.drafter.books.ledger import Ledger, read_all

    for rank in range(3):  # a launch on 3 drafters, 6 steps
        ledger = Ledger(tmp_path, rank)
        for step in range(6):
            ledger.record(step, step * 3 + rank, 10)
        ledger.close()
    Ledger(tmp_path, 1, start_step=4, world_size=2).close()  # rank 1 cuts its own file only
    assert max(e["step"] for e in read_all(tmp_path) if e["rank"] == 2) == 5
    Ledger(tmp_path, 0, start_step=4, world_size=2).close()  # resumed at step 4 on 2 drafters
    assert sorted(e["g"] for e in read_all(tmp_path)) == list(range(12))  # steps 0-3 of every rank, nothing after
