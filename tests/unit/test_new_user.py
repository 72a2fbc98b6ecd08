"""What a new user met in the first week (issue 49): each defect, in process or one short
console-script run."""

from launcher.progress import ProgressLine, describe_window

SMALL_RUN = {"step": 20, "loss": 5.1, "tau": 1.4, "coverage": 0.5, "tokens_per_s": 17.3, "steps": 10}


def test_a_small_cpu_run_shows_its_rate_in_tok_s_not_zero_ktok_s():
    live = ProgressLine().format(step=20, total=100, window=SMALL_RUN)
    assert live.endswith("| loss 5.100 τ 1.40 cov 50% 17.3 tok/s"), live
    assert describe_window(SMALL_RUN).endswith("coverage 50% 17.3 tok/s")
    assert describe_window({**SMALL_RUN, "tokens_per_s": 2_345_000.0}).endswith(" 2.3 Mtok/s")
