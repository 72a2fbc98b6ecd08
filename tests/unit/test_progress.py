"""The live line: step and ETA first within 80 columns; an ETA on training time; no repeats in a log file."""

import time

from launcher.progress import ProgressLine

WINDOW = {
    "step": 99_990,
    "loss": 10.1234,
    "tau": 13.59,
    "coverage": 1.0,
    "tokens_per_s": 117_300.0,
    "data_wait_frac": 0.1,
    "steps": 10,
}


def test_a_long_run_fits_80_columns_with_step_and_eta_first():
    line = ProgressLine()
    line.format(step=10, total=100_000, train_s=1.0)
    text = line.format(step=99_990 - 9_000, total=100_000, window=WINDOW, train_s=1_000_000.0)
    assert text.startswith("step 90990/100000 91.0% ETA 27h") and len(text) <= 80, (len(text), text)
    assert text.endswith("| loss 10.123 τ 13.59 cov 100% 117.3 Ktok/s")


def test_eta_counts_training_time_so_a_pause_neither_grows_it_nor_shrinks_it():
    line = ProgressLine()
    line.format(step=100, total=1000, train_s=10.0)
    before = line.format(step=200, total=1000, train_s=20.0)  # 10 steps per training second
    assert "ETA 1m20s" in before
    time.sleep(0.3)  # an evaluation: neither figure moves
    assert line.format(step=200, total=1000, train_s=20.0) == before
    after = line.format(step=300, total=1000, train_s=30.0)  # wall time of the pause not counted
    assert "ETA 1m10s" in after


def test_a_restarted_drafter_starts_the_rate_again():
    line = ProgressLine()
    line.format(step=100, total=1000, train_s=50.0)
    line.format(step=200, total=1000, train_s=60.0)
    line.format(step=150, total=1000, train_s=2.0)  # resumed from a checkpoint: new clock
    assert "ETA 1m15s" in line.format(step=250, total=1000, train_s=12.0)


def test_in_a_log_file_a_line_is_printed_only_when_it_changed(tmp_path):
    log = tmp_path / "up.log"
    with open(log, "w") as stream:
        line = ProgressLine(stream=stream, every_s=0.0)
        texts = [line.format(step=s, total=50, window=dict(WINDOW, step=s), train_s=s / 10) for s in (10, 20)]
        for _ in range(5):  # an eval pause: the same figures, polled
            line.show(texts[1])
        line.show(line.format(step=20, total=50, window=dict(WINDOW, step=20), train_s=2.0))
        line.show(line.format(step=30, total=50, window=dict(WINDOW, step=30), train_s=3.0))
    lines = log.read_text().splitlines()
    assert len(lines) == 2 and lines[0].startswith("step 20/50") and lines[1].startswith("step 30/50"), lines
    assert "ETA 0m03s" in lines[0] and "ETA 0m02s" in lines[1]  # 10 steps per training second, steady


def test_in_a_log_file_lines_are_spaced_by_every_s(tmp_path):
    with open(tmp_path / "up.log", "w") as stream:
        line = ProgressLine(stream=stream, every_s=3600.0)
        line.show("step 1/9")
        line.show("step 2/9")  # changed, but not due yet
    assert (tmp_path / "up.log").read_text().splitlines() == ["step 1/9"]
