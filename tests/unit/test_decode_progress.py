"""The progress line of a long decoding (services/decoding/decode_progress.py): at most one line per period,
with the phase, tokens done of the total, the rate and the time left at that rate."""

from services.decoding.decode_progress import Progress


def test_a_line_every_period_with_rate_and_time_left():
    now = [0.0]
    lines = []
    progress = Progress("eval", every=10, say=lines.append, clock=lambda: now[0])
    progress.phase("greedy references", total_tokens=1000)
    for _ in range(5):  # 100 tokens a second for 5 s: nothing said yet
        now[0] += 1
        progress.add(100)
    assert lines == []
    for _ in range(6):
        now[0] += 1
        progress.add(50)
    assert len(lines) == 1
    assert lines[0] == "eval: greedy references 750/1,000 tokens (75 %), 75 tok/s, at most 3 s left"
    progress.phase("drafter", total_tokens=500)
    now[0] += 10
    progress.add(100)
    assert lines[-1].startswith("eval: drafter 100/500 tokens (20 %), 10 tok/s, at most 40 s left")
