"""`launcher report`'s figures from a metrics.jsonl written by hand: throughput is tokens ÷ time over
windows of different lengths, and the PNG's labels do not overlap (no workers, fast)."""

import json

import pytest

from launcher.report import report

# (step, tokens all ranks trained in the window, its seconds): a long window, a short fast one, a slow
# one with an evaluation in it. The mean of the three rates is 10 833 tok/s; tokens ÷ time is 5 025.
WINDOWS = [(10, 100_000, 10.0), (11, 1_000, 0.05), (30, 50_000, 20.0)]


def write_metrics(run_dir, with_window_fields=True):
    run_dir.mkdir(exist_ok=True)
    lines, done = [], 0
    for step, tokens, seconds in WINDOWS:
        done += tokens
        record = {
            "step": step,
            "loss": 4.0,
            "tau": 2.0,
            "lr": 1e-3,
            "tokens_per_s": round(tokens / seconds, 1),
            "tokens_done": done,
            "samples_done": step,
            "data_wait_frac": 0.5 if step == 30 else 0.0,
        }
        if with_window_fields:
            record.update(window_tokens=tokens, window_s=seconds)
        lines.append(json.dumps(record))
    lines.append(json.dumps({"step": 30, "eval": True, "loss": 4.1, "tau": 1.9}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def throughput_line(lines):
    return next(line for line in lines if line.startswith("throughput:"))


def test_report_throughput_is_tokens_over_time_not_the_mean_of_rates(tmp_path):
    lines, _ = report(write_metrics(tmp_path / "run"), out=tmp_path / "p.png")
    tokens, seconds = sum(w[1] for w in WINDOWS), sum(w[2] for w in WINDOWS)
    rates = [w[1] / w[2] for w in WINDOWS]
    assert f"throughput: {tokens / seconds:,.0f} tokens/s" in throughput_line(lines)
    assert f"{sum(rates) / len(rates):,.0f}" not in throughput_line(lines)
    assert "last 3 records, 30 s" in throughput_line(lines)
    assert "data wait 33%" in throughput_line(lines)  # 10 s of 30 waited, weighted by time too


def test_files_without_the_window_fields_give_the_same_figure_from_the_counters(tmp_path):
    """Older metrics.jsonl: each window's tokens from tokens_done, its time from its rate; the first
    line has no line before it and is left out."""
    lines, _ = report(write_metrics(tmp_path / "run", with_window_fields=False), out=tmp_path / "p.png")
    tokens, seconds = sum(w[1] for w in WINDOWS[1:]), sum(w[2] for w in WINDOWS[1:])
    assert f"throughput: {tokens / seconds:,.0f} tokens/s (tokens ÷ time of the last 2 records" in throughput_line(
        lines
    )


def test_no_label_of_the_png_overlaps_another_or_leaves_the_figure(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from launcher.report import figure, read_metrics

    train, evals = read_metrics(write_metrics(tmp_path / "run"))
    acceptance = [{"step": 30, "acceptance_per_step": 2.5, "final": True, "random": {"acceptance_per_step": 1.0}}]
    fig = figure(train, evals, "a-run-name-of-some-length-2026-01-01", acceptance)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = [fig._suptitle] + [t for ax in fig.axes for t in (ax.title, ax.yaxis.label, ax.xaxis.label)]
    boxes = [t.get_window_extent(renderer) for t in texts]
    whole = fig.bbox
    for text, box in zip(texts, boxes):
        assert whole.x0 <= box.x0 and box.x1 <= whole.x1 and whole.y0 <= box.y0 and box.y1 <= whole.y1, text.get_text()
    for i, (a, box_a) in enumerate(zip(texts, boxes)):
        for b, box_b in zip(texts[i + 1 :], boxes[i + 1 :]):
            assert not box_a.overlaps(box_b), (a.get_text(), b.get_text())
    plt.close(fig)
