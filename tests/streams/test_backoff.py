"""The reconnect policy (streams/backoff.py), pure: no clock, no sleep, an injected rng."""

import random

import pytest

from streams.backoff import FIRST_RETRY_MAX_S, Backoff

NO_JITTER, MOST_JITTER = (lambda: 0.0), (lambda: 0.999999)


def test_pauses_double_up_to_the_cap():
    b = Backoff(0.5, 30, 10, rng=NO_JITTER)
    assert [b.after_failure() for _ in range(9)] == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]


@pytest.mark.parametrize("rng", [NO_JITTER, MOST_JITTER, random.Random(7).random])
def test_jitter_never_exceeds_the_cap_and_only_shortens(rng):
    b = Backoff(0.5, 30, 10, jitter=0.2, rng=rng)
    plain = Backoff(0.5, 30, 10, rng=NO_JITTER)
    for _ in range(200):
        pause, ceiling = b.after_failure(), plain.after_failure()
        assert 0.8 * ceiling <= pause <= ceiling <= 30


def test_a_session_that_ends_at_once_backs_off_like_a_refusal():
    b = Backoff(0.5, 30, 10, rng=NO_JITTER)
    assert [b.after_session(delivered_s=0.0) for _ in range(4)] == [0.5, 1, 2, 4]
    assert b.after_failure() == 8  # failures and short sessions share one schedule
    assert b.after_session(delivered_s=9.99) == 16  # shorter than reset_after_s: no reset


def test_only_a_long_enough_session_resets_and_its_first_retry_comes_within_1_s():
    b = Backoff(5.0, 30, 10, rng=NO_JITTER)  # an initial pause longer than FIRST_RETRY_MAX_S
    for _ in range(5):
        b.after_failure()
    assert b.after_session(delivered_s=10.0) == FIRST_RETRY_MAX_S == 1.0
    assert [b.after_failure() for _ in range(3)] == [10, 20, 30]  # growth starts again from initial_s


@pytest.mark.parametrize("args, message", [
    ((0, 30, 10), "initial_s, max_s, reset_after_s > 0"),
    ((0.5, 30, 10, 1.0), "0 <= jitter < 1"),
])
def test_bad_parameters(args, message):
    initial, cap, reset, *jitter = args
    with pytest.raises(ValueError, match=message):
        Backoff(initial, cap, reset, **({"jitter": jitter[0]} if jitter else {}))
