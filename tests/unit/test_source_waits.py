"""How long a drafter's request waits before it is asked again (services/drafter/training/source.py): the
configured transport.resend_after_s, else derived from how long answers have taken."""

from services.drafter.training.source import RESEND_MAX_S, RESEND_MIN_S, resend_wait


def test_a_configured_wait_is_used_as_is():
    assert resend_wait(300.0, 0.2) == 300.0 and resend_wait(5.0, 60.0) == 5.0


def test_the_derived_wait_follows_the_slowest_answer_within_its_bounds():
    assert resend_wait(0.0, 0.0) == RESEND_MAX_S  # no answer yet: a first batch may wait for a compile
    assert resend_wait(0.0, 0.05) == RESEND_MIN_S  # fast answers: re-asked after the floor, not 5 minutes
    assert resend_wait(0.0, 6.0) == 24.0  # 4x the slowest answer
    assert resend_wait(0.0, 90.0) == RESEND_MAX_S
    assert RESEND_MIN_S < 30 <= RESEND_MAX_S
