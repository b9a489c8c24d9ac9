"""How the dense stage cuts its missing shards into Ray tasks (orchestrator/sweep/dense_work.py ``shard_runs``):
one shard per CPU task; on GPUs, runs of consecutive shards, at most two per GPU slot, so a GPU task (whose worker
process exits after it) loads the model and reads its dataset once for several shards."""
import pytest

from orchestrator.sweep.dense_work import shard_runs


def _plan(n, size=256):
    return [(i, i * size, (i + 1) * size) for i in range(n)]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("n,slots,lengths", [(20, 0, [1] * 20), (20, 1, [10, 10]), (20, 4, [2, 3, 2, 3, 2, 3, 2, 3]),
                                             (5, 1, [2, 3]), (3, 4, [1, 1, 1]), (1, 1, [1]), (0, 2, []),
                                             (7, 2, [1, 2, 2, 2])])
def test_runs_cover_the_plan_in_order_two_per_slot_at_most(n, slots, lengths):
    plan = _plan(n)
    runs = shard_runs(plan, slots)
    assert [len(r) for r in runs] == lengths  # near-equal: lengths differ by one at most
    assert [s for r in runs for s in r] == plan  # every shard once, in plan order
