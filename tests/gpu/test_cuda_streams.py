"""tasks/cuda_streams.py on a CUDA device: one side stream per role and process, never shared by two roles, though
torch's pool hands the same streams out again; captured heals fed by the store's CUDA stream, heal after heal in one
process (a reused trial actor), each capture on the heal's stream while the prefetch thread copies on its own,
heal as the same captured heal fed the same rows from memory and leave allocated memory where it was. Until
2026-11-30 every heal drew two new warm-up streams (each new stream that runs a matrix product keeps cuBLAS
workspaces for the life of the process: +130 MiB a heal on an H200) and the store one per epoch (one of which could
be the capture's). Skipped without CUDA."""
from __future__ import annotations

import gc
import warnings

import pytest
import torch

from tasks.cuda_streams import POOL, side_stream
from tasks.healing import HEALERS, HealConfig, in_memory_batches
from tasks.pruning import mask_violations
from tasks.store import TargetStore, content_key
from tests.gpu.test_graph_step import _on_cuda
from tests.store.test_store import write_all

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
STARFISH = HEALERS.get("starfish")


@pytest.mark.timeout(60)
def test_one_stream_per_role_though_the_pool_comes_round():
    heal, copy = side_stream("cuda", "heal"), side_stream(torch.device("cuda", torch.cuda.current_device()), "copy")
    drawn = {torch.cuda.Stream().cuda_stream for _ in range(2 * POOL)}
    assert heal.cuda_stream in drawn  # torch's pool hands a role's stream to anyone who asks: why roles keep theirs
    assert side_stream(torch.cuda.current_device(), "heal") is heal and side_stream("cuda", "copy") is copy
    assert heal.cuda_stream != copy.cuda_stream


@pytest.mark.timeout(300)
def test_captured_heals_fed_by_the_store_stream_heal_as_from_memory_and_leave_no_memory(heal_case, step_graphs,
                                                                                         tmp_path):
    cfg = HealConfig(lr=1e-2, epochs=6, batch_size=8, graph="step")  # 6 epochs of 4 batches of 8 and one of 4
    store, key = TargetStore(tmp_path / "s"), content_key({"test": "captured heals from the store"})
    write_all(store, key, heal_case("timm_vit", "qkv_out_mlp", n=36).targets, shard_size=8)
    allocated, caught = [], []
    for _ in range(6):  # 36 epochs streamed in all: more than the pool's 32 streams
        with store.open(key) as reader, warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            streamed = _on_cuda(heal_case("timm_vit", "qkv_out_mlp", sparsity=0.8, n=36))
            streamed.ctx.batches = lambda e: reader.iter_batches(8, shuffle=True, seed=0, epoch=e, device="cuda")
            rs = STARFISH.heal(streamed.ctx, cfg)
            ram = {k: v.cuda() for k, v in reader.load_all().items()}  # the same bits (float16)
            fed = _on_cuda(heal_case("timm_vit", "qkv_out_mlp", sparsity=0.8, n=36))
            fed.ctx.batches = in_memory_batches(ram, 8, 0, order=lambda e: reader.epoch_order(shuffle=True, seed=0,
                                                                                              epoch=e))
            rm = STARFISH.heal(fed.ctx, cfg)
        caught += [str(x.message) for x in w]
        assert rs.steps == rm.steps == 30 and rs.epoch_losses == pytest.approx(rm.epoch_losses, rel=1e-5, abs=1e-7)
        assert mask_violations(streamed.model, streamed.ctx.masks) == 0
        sa, sb = streamed.model.state_dict(), fed.model.state_dict()
        assert all(torch.allclose(sa[k], sb[k], rtol=1e-4, atol=1e-6) for k in sa if sa[k].is_floating_point())
        del streamed, fed, ram, rs, rm, sa, sb
        gc.collect()
        allocated.append(torch.cuda.memory_allocated())
    assert all(s.failed == {} and len(s.captured) == 2 for s in step_graphs), [s.failed for s in step_graphs]
    print("allocated after each pair of heals:", allocated)
    print("AccumulateGrad stream warnings:", sum("AccumulateGrad" in m for m in caught), "of", len(caught))
    assert allocated[1:] == [allocated[1]] * 5, allocated
