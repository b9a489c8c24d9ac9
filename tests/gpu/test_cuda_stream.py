"""The accelerator paths of the store and the loop on a CUDA device: the side-stream store stream yields the CPU
stream's rows and bits on the GPU; a bf16 heal keeps every mask and its weights in float32; a NaN batch in the
middle of an epoch on the GPU is undone like on the CPU (the device-side guard). Skipped without CUDA."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.store import TargetStore
from tests.store.test_store import KEY, make_blocks, write_all

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("batch,window", [(4, 1), (5, 3), (32, 1)])
def test_cuda_stream_equals_cpu_stream(tmp_path, batch, window):
    st = TargetStore(tmp_path / "s")
    blocks = make_blocks(23, torch.float16)
    write_all(st, KEY, blocks, shard_size=4)
    with st.open(KEY) as r:
        for epoch in (0, 1):
            kw = dict(shuffle=True, seed=3, epoch=epoch, window=window)
            cpu = list(r.iter_batches(batch, **kw))
            gpu = list(r.iter_batches(batch, device="cuda", **kw))
            assert len(cpu) == len(gpu)
            for (rc, tc), (rg, tg) in zip(cpu, gpu):
                assert np.array_equal(rc, rg)
                for k in tc:
                    assert tg[k].is_cuda and torch.equal(tc[k].view(torch.int16), tg[k].cpu().view(torch.int16))


@pytest.mark.timeout(120)
def test_bf16_heal_on_the_gpu_keeps_masks(heal_case):
    from tasks.healing import HEALERS, HealConfig
    from tasks.pruning import mask_violations

    case = heal_case("timm_vit", "qkv_out_mlp", sparsity=0.8)
    case.model.cuda()
    case.ctx.masks = {k: v.cuda() for k, v in case.masks.items()}
    case.ctx.images = case.ctx.images.cuda()
    res = HEALERS.get("starfish").heal(case.ctx, HealConfig(lr=1e-2, epochs=3, batch_size=8, precision="bf16"))
    assert res.epoch_losses[-1] < 0.9 * res.epoch_losses[0]
    assert mask_violations(case.model, case.ctx.masks) == 0
    assert all(p.dtype == torch.float32 and p.is_cuda for p in case.model.parameters())
