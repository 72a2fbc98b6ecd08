"""Real acceptance by the clock (services/drafter/books/cadence.py): when a pass is due, its budget, what it
costs, and the words the launcher prints about it."""

import random
from types import SimpleNamespace

import pytest

from services.drafter.books.cadence import COST_SHARE, CUDA_EVERY_S, Cadence, every_s_for


def test_the_default_is_five_minutes_on_cuda_and_off_on_the_cpu():
    assert every_s_for(-1.0, "cuda") == CUDA_EVERY_S == 300.0
    assert every_s_for(-1.0, "cpu") == 0.0
    assert every_s_for(0.0, "cuda") == 0.0 and every_s_for(30.0, "cpu") == 30.0  # as set, anywhere


def test_a_pass_is_cut_at_five_percent_of_its_interval():
    assert Cadence(300.0, budget_s=60.0).budget_s == pytest.approx(15.0)
    assert Cadence(300.0, budget_s=10.0).budget_s == 10.0  # eval.budget_s, when smaller


def test_passes_come_every_interval_while_they_fit_their_budget():
    c = Cadence(300.0, budget_s=60.0)
    assert not c.due(1e9)  # training has not started
    c.begin(1000.0)
    c.begin(1100.0)  # the first call counts
    assert not c.due(1299.0) and c.due(1300.0)
    assert c.record(1300.0, 1310.0) == {
        "pass_s": 10.0,
        "passes": 1,
        "spent_s": 10.0,
        "wall_s": 310.0,
        "cost_frac": pytest.approx(10 / 310, abs=1e-4),
    }
    assert not c.due(1599.0) and c.due(1600.0)  # start to start


def test_a_pass_that_runs_over_delays_the_next_one_until_the_cost_is_back_within_its_share():
    c = Cadence(300.0, budget_s=60.0)
    c.begin(0.0)
    c.record(300.0, 340.0)  # the first pass also sets up (tokenizer, prompts, greedy references): 40 s
    assert not c.due(600.0) and not c.due(799.0)  # 40 s > 5 % of 799 s; its set-up is no guess for the next
    assert c.due(800.0)
    c.record(800.0, 830.0)  # 30 s: over its 15 s budget
    # the next one as long as the last: (70 + 30) s within 5 % of the training time then
    assert not c.due(1100.0) and not c.due(1969.0) and c.due(1970.0)
    c.record(1970.0, 2000.0)
    assert c.figures(2000.0)["cost_frac"] <= COST_SHARE


@pytest.mark.parametrize("seconds", [4.0, 14.0, 20.0, 40.0])
def test_over_a_run_the_cost_stays_within_its_share_and_no_interval_is_short(seconds):
    """Passes of about `seconds` (within 15 s: every interval; past it: as often as 5 % allows), the
    first 45 s: the cost after the first few passes, and at the end, is within 5 %."""
    rng, c, now, starts = random.Random(0), Cadence(300.0, budget_s=60.0), 0.0, []
    c.begin(now)
    while now < 20 * 3600:
        now += 0.5  # a train step
        if c.due(now):
            starts.append(now)
            took = 45.0 if len(starts) == 1 else seconds * rng.uniform(0.99, 1.0)
            c.record(now, now + took)
            now += took
            if len(starts) > 3:
                assert c.figures(now)["cost_frac"] <= COST_SHARE, len(starts)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert min(gaps) >= 300.0 and c.spent / now <= COST_SHARE
    if seconds <= 15.0:  # within the budget: every 300 s (+ the pass's own time and a step)
        assert max(gaps[2:]) <= 300.0 + seconds + 0.5


def test_off_is_never_due_but_still_counts_the_passes_of_eval_every():
    c = Cadence(0.0, budget_s=60.0)
    c.begin(0.0)
    assert not c.due(1e6)
    assert c.record(100.0, 104.0)["spent_s"] == 4.0 and c.figures(200.0)["cost_frac"] == 0.02
    assert c.record(300.0, 305.0)["passes"] == 2
    assert Cadence(300.0, 60.0).figures(5.0) == {}  # before training: no figures


@pytest.mark.parametrize(
    "held_out, prompts, targets, every_s, off",
    [
        (True, 16, 1, 300.0, False),
        (False, 16, 1, 300.0, True),  # training lines only: off, and said once
        (False, 0, 1, 300.0, False),  # eval.num_prompts = 0: no real acceptance at all, nothing to say
        (False, 16, 0, 300.0, False),  # --synthetic: no targets to verify
        (False, 16, 1, 0.0, False),  # off by the config or the device
    ],
)
def test_without_held_out_prompts_the_clocks_passes_are_off_and_say_why(held_out, prompts, targets, every_s, off):
    from services.drafter.books.bookkeeping import Bookkeeping

    said = []
    bookkeeping = SimpleNamespace(
        settings=SimpleNamespace(held_out_prompts=held_out, spec_eval_prompts=prompts, target_path="/models/t"),
        cadence=Cadence(every_s, 60.0),
        num_targets=targets,
        acceptance_off=said.append,
    )
    Bookkeeping.check_periodic(bookkeeping)
    assert bookkeeping.cadence.every_s == (every_s if held_out and prompts and targets else 0.0)
    assert len(said) == off
    if off:
        assert "no held-out split" in said[0] and "data.eval_fraction" in said[0] and "eval.every_s" in said[0]


def test_the_console_line_and_the_total():
    from launcher.progress import describe_acceptance
    from launcher.report import describe_cost

    figures = {
        "step": 1200,
        "prompts": 16,
        "held_out": True,
        "sets": ["held-out"],
        "acceptance_per_prompt": 3.214,
        "acceptance_per_step": 3.05,
        "tokens_per_forward": 2.951,
        "lossless": 15,
        "differences": [{"near_tie": True}],
        "pass_s": 4.12,
        "passes": 3,
        "spent_s": 11.7,
        "wall_s": 900.0,
        "cost_frac": 0.013,
    }
    assert describe_acceptance(figures) == (
        "real acceptance @1200: 3.21 per prompt, 3.05 per step, 2.95 tokens/forward, lossless 15/16 "
        "(1 near-tie) on 16 held-out prompts; pass 4.1 s, real acceptance so far 1.3% of 900 s of training"
    )
    assert describe_cost(figures) == "real acceptance during training: 3 passes, 11.7 s of 900 s of training (1.3%)"
    assert describe_cost({**figures, "passes": 0}) is None  # none ran: nothing to say
    older = {k: v for k, v in figures.items() if k not in ("pass_s", "passes", "spent_s", "wall_s", "cost_frac")}
    assert describe_acceptance(older).endswith("on 16 held-out prompts") and describe_cost(older) is None
