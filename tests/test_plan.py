"""The run's plan: micro-batches per rank, optimizer steps and batches, from the data size and the config."""
from services.drafter.plan import SYNTHETIC_STEPS, Plan, make_plan


def counts(plan: Plan) -> tuple[int, int, int]:
    return plan.optimizer_steps, plan.micro_batches, plan.total_batches


def test_the_whole_data_on_several_ranks():
    assert counts(make_plan(15, epochs=1, drafters=2)) == (8, 8, 15)          # rank 1 pads g=15
    assert counts(make_plan(5, epochs=3, drafters=1)) == (15, 15, 15)


def test_max_steps_counts_optimizer_steps():
    assert counts(make_plan(15, 1, drafters=2, grad_accum=2, max_steps=3)) == (3, 6, 12)
    assert counts(make_plan(15, 1, drafters=2, grad_accum=2, max_steps=100)) == (4, 8, 15)   # the data ends first


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
