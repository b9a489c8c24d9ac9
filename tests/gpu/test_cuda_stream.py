"""The accelerator paths of the store and the loop on a CUDA device: the side-stream store stream yields the CPU
stream's rows and bits on the GPU; a bf16 heal keeps every mask and its weights in float32; a NaN batch in the
middle of an epoch on the GPU is undone like on the CPU (the device-side guard). Skipped without CUDA."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.healing import HEALERS, HealConfig
from tasks.pruning import mask_violations
from tasks.store import TargetStore
from tests.store.test_store import KEY, make_blocks, write_all

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("batch,window,cols", [(4, 1, None), (5, 3, None), (32, 1, None), (5, 3, ["logits"])])
def test_cuda_stream_equals_cpu_stream(tmp_path, batch, window, cols):
    """Every column, or only those a healer reads (``cols``: kl's logits), on the GPU as on the CPU."""
    st = TargetStore(tmp_path / "s")
    blocks = make_blocks(23, torch.float16)
    write_all(st, KEY, blocks, shard_size=4)
    with st.open(KEY, blocks=cols) as r:
        for epoch in (0, 1):
            kw = dict(shuffle=True, seed=3, epoch=epoch, window=window)
            cpu = list(r.iter_batches(batch, **kw))
            gpu = list(r.iter_batches(batch, device="cuda", **kw))
            assert len(cpu) == len(gpu)
            for (rc, tc), (rg, tg) in zip(cpu, gpu):
                assert np.array_equal(rc, rg) and list(tg) == list(tc) == (cols or list(blocks))
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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("graph", ["off", "step"])
def test_host_images_heal_as_device_images(heal_case, graph):
    """Calibration images over tasks/trial.py's IMAGES_ON_DEVICE_MAX stay in host memory: each batch is gathered into
    pinned memory and sent without blocking (tasks/healing/targets.py ``take_rows``); the heal equals the one with the
    images on the GPU, eager and captured. The supervised ``ce`` baseline's labeled set (host memory) heals too."""
    from tasks.healing.targets import take_rows
    from tests.gpu.test_graph_step import _on_cuda

    x, rows = torch.randn(6, 3, 8, 8), np.array([4, 0, 5, 4])
    y = take_rows(x, rows, torch.device("cuda"))
    assert y.is_cuda and torch.equal(y.cpu(), x[torch.as_tensor(rows)])
    cfg = HealConfig(lr=1e-2, epochs=3, batch_size=8, graph=graph)
    on_gpu = _on_cuda(heal_case("timm_vit", "qkv_out_mlp", sparsity=0.8, n=36))
    rg = HEALERS.get("starfish").heal(on_gpu.ctx, cfg)
    on_host = _on_cuda(heal_case("timm_vit", "qkv_out_mlp", sparsity=0.8, n=36))
    on_host.ctx.images = on_host.ctx.images.cpu()
    rh = HEALERS.get("starfish").heal(on_host.ctx, cfg)
    assert rh.steps == rg.steps == 15 and rh.epoch_losses == pytest.approx(rg.epoch_losses, rel=1e-6)
    sg, sh = on_gpu.model.state_dict(), on_host.model.state_dict()
    assert all(torch.allclose(sg[k], sh[k], rtol=1e-5, atol=1e-7) for k in sg if sg[k].is_floating_point())
    ce = _on_cuda(heal_case("timm_vit", "qkv_out_mlp", sparsity=0.8, n=36))
    assert not ce.ctx.labeled[0].is_cuda
    rc = HEALERS.get("ce").heal(ce.ctx, cfg)
    assert rc.epoch_losses[-1] < rc.epoch_losses[0] and mask_violations(ce.model, ce.ctx.masks) == 0
