"""bench/batched_eval.py on the CPU at a tiny shape (the GPU figures come from the same code), and
bench/soak.py's growth arithmetic on made-up samples."""

import json

import pytest

from bench import batched_eval, soak


@pytest.mark.slow
def test_batched_eval_decodes_the_same_tokens_both_ways_on_cpu(capsys):
    assert (
        batched_eval.main(
            [
                "--device",
                "cpu",
                "--shape",
                "tiny",
                "--prompts",
                "4",
                "--batch",
                "2",
                "--new",
                "6",
                "--cached-prompts",
                "4",
                "--prompt-len",
                "12",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["compared"] == 4 and result["same_tokens"] == 4  # fp32: no ties between the two ways
    assert result["batched"]["prompts"] == 4 and result["one_at_a_time"]["forwards_per_s"] > 0
    assert result["speedup"] == round(result["batched"]["prompts_per_s"] / result["one_at_a_time"]["prompts_per_s"], 2)


def made_up(t: float, rss: float, fds: int, ledger_kb: float, step: int) -> dict:
    return {
        "t": t,
        "roles": {"drafter": {"rss_mb": rss, "fds": fds, "threads": 9, "processes": 1}},
        "run_dir_mb": 5.0,
        "ledger_kb": ledger_kb,
        "step": step,
    }


def test_soak_growth_compares_the_first_and_last_thirds():
    hour = 3600.0
    # rss grows 10 MB an hour; a restart halfway drops it (the thirds still see the growth); fds stay flat
    samples = [
        made_up(i * hour / 10, 400 + 10 * i / 10 - (50 if i == 5 else 0), 30, 2.0 * i, 100 * i) for i in range(11)
    ]
    g = soak.growth(samples)
    assert g["drafter.fds"]["per_hour"] == 0 and g["drafter.threads"]["per_hour"] == 0
    assert abs(g["drafter.rss_mb"]["per_hour"] - 10) < 1e-6
    assert g["ledger_bytes_per_step"] == round(20 * 1024 / 1000, 1) and g["run_dir_mb"]["per_hour"] == 0
    assert soak.third_medians(samples[:5], lambda s: s["step"]) is None  # too few samples to say
