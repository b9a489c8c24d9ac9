"""tasks/cuda_streams.py without a GPU: a role's stream is drawn until it differs from the other roles' streams, from a
pool that hands out its members round robin (as torch's 32 pooled streams per device); a role outside ROLES is
refused before CUDA is touched. On a GPU: tests/gpu/test_cuda_streams.py."""
from __future__ import annotations

import itertools

import pytest

from tasks.cuda_streams import POOL, ROLES, distinct_draw, side_stream


def _pool(start: int = 0):
    """Draws from a round-robin pool of POOL handles, counted. -> (draw, drawn)"""
    it, drawn = itertools.cycle(range(POOL)), []
    for _ in range(start):
        next(it)

    def draw() -> int:
        drawn.append(next(it))
        return drawn[-1]
    return draw, drawn


@pytest.mark.timeout(10)
def test_a_draw_that_comes_round_to_a_taken_stream_draws_again():
    draw, drawn = _pool(start=5)
    assert distinct_draw(draw, lambda h: h, taken={7}) == 5 and drawn == [5]  # free at once: one draw
    draw, drawn = _pool(start=7)
    assert distinct_draw(draw, lambda h: h, taken={7, 8}) == 9 and drawn == [7, 8, 9]
    draw, drawn = _pool(start=31)  # the pool wraps: 31, 0, 1
    assert distinct_draw(draw, lambda h: h, taken={31, 0}) == 1 and drawn == [31, 0, 1]


@pytest.mark.timeout(10)
def test_a_pool_with_every_member_taken_is_an_error_not_a_loop():
    draw, drawn = _pool()
    with pytest.raises(RuntimeError, match=f"no stream distinct from {POOL} taken ones in {2 * POOL} draws"):
        distinct_draw(draw, lambda h: h, taken=set(range(POOL)))
    assert len(drawn) == 2 * POOL


@pytest.mark.timeout(10)
def test_an_unknown_role_is_refused_before_cuda_is_touched():
    assert ROLES == ("heal", "copy")
    with pytest.raises(ValueError, match="role must be one of heal, copy, got 'capture'"):
        side_stream("cuda", "capture")
