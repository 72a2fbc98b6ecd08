"""The run's plan: micro-batches per rank, optimizer steps and batches, from the data size and the config."""

import pytest

from services.run.schedule import SYNTHETIC_STEPS, Plan, make_plan


def counts(plan: Plan) -> tuple[int, int, int]:
    return plan.optimizer_steps, plan.micro_batches, plan.total_batches


def test_the_whole_data_on_several_ranks():
    assert counts(make_plan(15, epochs=1, drafters=2)) == (8, 8, 15)  # rank 1 pads g=15
    assert counts(make_plan(5, epochs=3, drafters=1)) == (15, 15, 15)


def test_max_steps_counts_optimizer_steps():
    assert counts(make_plan(15, 1, drafters=2, grad_accum=2, max_steps=3)) == (3, 6, 12)
    assert counts(make_plan(15, 1, drafters=2, grad_accum=2, max_steps=100)) == (4, 8, 15)  # the data ends first


def test_the_last_optimizer_step_is_whole():
    # 10 batches on 2 ranks = 5 each: 3 optimizer steps of 2, the sixth micro-batch empty on both ranks
    assert counts(make_plan(10, 1, drafters=2, grad_accum=2)) == (3, 6, 10)


def test_synthetic_data_has_no_end():
    assert counts(make_plan(None, 1, drafters=2, grad_accum=2, max_steps=4)) == (4, 8, 16)
    assert make_plan(None, 1, drafters=1).optimizer_steps == SYNTHETIC_STEPS


def test_round_trip_through_schedule_json():
    plan = make_plan(15, 2, drafters=3, grad_accum=2, max_steps=4)
    assert Plan.from_dict({**plan.to_dict(), "targets": 2}) == plan
    assert plan.describe() == "4 optimizer steps x 2 micro-batches on each of 3 drafters: 24 batches"


def trained(plan: Plan, start_micro: int, end_micro: int) -> list[int]:
    """The real batches every rank trains over micro-steps [start_micro, end_micro) of `plan`."""
    return [
        g
        for m in range(start_micro, end_micro)
        for d in range(plan.drafters)
        if (g := plan.g_of(m, d)) < plan.total_batches
    ]


@pytest.mark.parametrize("before, after, accum", [(2, 1, 1), (1, 2, 1), (2, 3, 2), (3, 2, 2), (4, 1, 3)])
def test_a_resume_on_another_number_of_drafters_trains_every_batch_once(before, after, accum):
    for stop_step in (1, 2, 3):
        first = make_plan(23, epochs=2, drafters=before, grad_accum=accum)
        done = first.batches_done(stop_step * accum)  # what the checkpoint at stop_step records
        assert done == min(stop_step * accum * before, 46)
        second = make_plan(23, 2, drafters=after, grad_accum=accum, first_step=stop_step, first_g=done)
        g = trained(first, 0, stop_step * accum) + trained(second, stop_step * accum, second.micro_batches)
        assert sorted(g) == list(range(46)), (before, after, stop_step)
        assert second.total_batches == 46 and second.batches_done(second.micro_batches) == 46
        # the last optimizer step is the only one with empty batches, and it has at least one real one
        assert second.g_of(second.micro_batches - accum, 0) < 46 <= second.horizon_batches


def test_a_resumed_plan_counts_its_steps_from_the_checkpoint():
    plan = make_plan(15, 1, drafters=1, first_step=3, first_g=6)  # 2 drafters trained 6 batches in 3 steps
    assert counts(plan) == (12, 12, 15) and plan.g_of(3, 0) == 6 and plan.g_of(11, 0) == 14
    assert counts(make_plan(15, 1, drafters=1, max_steps=5, first_step=3, first_g=6)) == (5, 5, 8)
    assert "resumed at step 3 with 6 done" in plan.describe()
    finished = make_plan(15, 1, drafters=1, first_step=8, first_g=16)  # empty slots past the end are not data
    assert counts(finished) == (8, 8, 15) and finished.first_g == 15
    older = {k: v for k, v in plan.to_dict().items() if k not in ("first_step", "first_g")}  # without segments
    with pytest.raises(KeyError):  # not read: `launcher status` shows no plan for it
        Plan.from_dict(older)
