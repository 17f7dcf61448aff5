"""The router's estimate of a prompt's wait on a worker: tokens queued over the rate learned
from the worker's answers, with no rate (and so no refusal) until it has been measured."""

from __future__ import annotations

import math

import pytest

from router.workers.backlog import HALF_LIFE, Backlog


def test_the_rate_is_tokens_computed_over_seconds_busy():
    b = Backlog(since=0.0)
    b.add(1000, now=0.0)
    assert b.rate is None and b.wait(500) == 0.0  # not measured: nothing is refused
    b.answered(1000, 800, now=0.5)  # 200 were cached: 800 computed in 0.5 s
    assert b.tokens == 0
    assert b.rate is None  # half a second is too little to trust
    b.add(600, now=10.0)  # idle seconds do not count as busy
    b.answered(600, 600, now=10.75)
    decay = 0.5 ** (10.25 / HALF_LIFE)  # from the first answer to the second
    busy = HALF_LIFE / math.log(2) * (1 - 0.5 ** (0.5 / HALF_LIFE))  # ~0.5 s, decayed since
    busy = busy * decay + HALF_LIFE / math.log(2) * (1 - 0.5 ** (0.75 / HALF_LIFE))
    done = 800 * decay + 600
    assert b.rate == pytest.approx(done / busy, rel=1e-12)
    assert b.rate == pytest.approx(1084.053, abs=1e-3)  # 1,231.3 tokens in 1.1358 busy seconds
    b.add(2000, now=11.0)  # idle since the answer: both decay alike, the rate stays
    assert b.rate == pytest.approx(1084.053, abs=1e-3)
    assert b.wait(400) == pytest.approx(2400 / 1084.053, abs=1e-6)


def test_old_work_fades_so_the_rate_follows_the_load():
    b = Backlog(since=0.0)
    b.add(4000, now=0.0)
    b.answered(4000, 4000, now=2.0)  # 2,000 tokens/s while alone
    assert b.rate == pytest.approx(2046.566, abs=1e-3)  # busy seconds fade as they pass: 1.954
    for t in range(100, 400, 4):  # later: 500 tokens in 2 s, again and again
        b.add(500, now=t)
        b.answered(500, 500, now=t + 2)
    # tokens count when answered, busy seconds as they pass: a slight bias up from 250
    assert b.rate == pytest.approx(255.838, abs=1e-3)


def test_an_abandoned_prompt_leaves_the_backlog_without_counting_as_work():
    b = Backlog(since=0.0)
    b.add(300, now=0.0)
    b.add(200, now=0.0)
    b.answered(300, 0, now=1.0)  # the client left before its first token
    assert b.tokens == 200 and b.done == 0.0
    with pytest.raises(AssertionError):
        b.answered(500, 0, now=1.5)
