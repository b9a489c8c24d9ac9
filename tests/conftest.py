"""Shared fixtures for the tasks/ unit tests: tiny random-init models (never trained) and healing setups."""
from __future__ import annotations

import copy
from dataclasses import dataclass, fields

import pytest
import torch

from tasks.data import load_digits
from tasks.healing import HealContext, dense_targets, in_memory_batches, steps_per_epoch
from tasks.models import MODELS, get_adapter
from tasks.models.reference import _build_resnet
from tasks.pruning import PruneContext, apply_masks, make_masks, region


@pytest.fixture(autouse=True, scope="session")
def _stream_cache(tmp_path_factory):
    """Streamed datasets' machine cache (tasks/data/stream_cache.py) in the session's temporary directory, not in
    ~/.cache: set in the environment, so the CLI's subprocesses and Ray's workers use it too."""
    import os

    from tasks.data.stream_cache import CACHE_ENV

    old = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("stream-cache"))
    yield
    if old is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = old


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """One intra-op thread: tiny models are ~20x faster without thread hand-offs on a shared 2-core box."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _timm_vit():
    from timm.models.vision_transformer import VisionTransformer

    m = VisionTransformer(img_size=16, patch_size=4, in_chans=1, num_classes=10, embed_dim=32, depth=2,
                          num_heads=4)  # mlp hidden 128, 17 tokens
    for lin in m.modules():  # timm's std-0.02 init leaves attention ~uniform, so Q/K pruning would be invisible
        if isinstance(lin, torch.nn.Linear):
            torch.nn.init.normal_(lin.weight, std=lin.in_features ** -0.5)
    return m


def _tv_vit():
    from torchvision.models import VisionTransformer

    return VisionTransformer(image_size=16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
                             num_classes=10)  # 3 input channels (fixed by torchvision)


BUILDERS = {"timm_vit": (_timm_vit, 1), "tv_vit": (_tv_vit, 3),
            "resnet": (lambda: _build_resnet(MODELS.get("resnet_digits").arch), 1)}


def build_model(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return BUILDERS[kind][0]().eval()


def calib_images(kind: str, n: int) -> torch.Tensor:
    """First n digits calibration images (N, C, 16, 16), channels repeated for 3-channel models."""
    x = load_digits(0)["calibration"].images[:n]
    return x.repeat(1, BUILDERS[kind][1], 1, 1).contiguous()


@dataclass
class HealCase:
    model: torch.nn.Module
    entries: list
    masks: dict
    ctx: HealContext
    targets: dict
    before: dict  # state_dict of the pruned model before healing (clones)

    def nan_in_batch(self, batch_index: int, batch: int = 8) -> "HealCase":
        """A NaN in the last block's target at the first row of epoch 1's batch ``batch_index`` (seed 0; every epoch
        holds that row), the batches rebuilt over the changed targets. -> self"""
        row = int(list(in_memory_batches(self.targets, batch, seed=0)(0))[batch_index][0][0])
        self.targets[self.ctx.blocks[-1][0]][row].view(-1)[0] = float("nan")
        self.ctx.batches = in_memory_batches(self.targets, batch, seed=0)
        return self

    def assert_invariants(self, allowed: set[str] = frozenset()):
        """Mask invariant + nothing outside the trainable region changed (parameters and buffers), except the
        state_dict names in ``allowed`` (a healer's ``may_change``); masks on companion params (biases) hold."""
        sd = self.model.state_dict()
        scoped = {e.param for e in self.entries}
        for k, m in self.masks.items():
            assert torch.all(sd[k][~m] == 0), f"{k}: masked entries not 0"
        for k, v in sd.items():
            if k not in scoped and k not in allowed:
                assert torch.equal(v, self.before[k]), f"{k} changed outside the scope"
        for e in self.entries:
            p, m, b = sd[e.param], self.masks[e.param], self.before[e.param]
            assert torch.all(p[~m] == 0), f"{e.param}: masked entries not 0"
            inside = torch.zeros_like(m)
            region(inside, e).fill_(True)
            if e.param not in allowed:  # a healer may declare rows outside the region (qk_train='qkv': V rows)
                assert torch.equal(p[~inside], b[~inside]), f"{e.param}: rows outside the region changed"
            # zeros inside the region: exactly the masked ones (surviving weights stay nonzero)
            assert int((region(p, e) == 0).sum()) == int((~region(m, e)).sum()), e.param


def make_heal_case(kind: str, scope: str, sparsity: float = 0.8, pruner: str = "magnitude", n: int = 32,
                   batch: int = 8, seed: int = 0, images: torch.Tensor | None = None) -> HealCase:
    dense = build_model(kind, seed)
    adapter = get_adapter(dense)
    imgs = calib_images(kind, n) if images is None else images
    targets = dense_targets(dense, adapter.blocks(dense), imgs)
    model = copy.deepcopy(dense)
    entries = adapter.scope(model, scope)
    masks = make_masks(model, entries, pruner, sparsity, seed=seed,
                       ctx=PruneContext(model, adapter, entries, calib_images=imgs))
    apply_masks(model, masks)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    extra = {}  # optional context some healers need (present once tasks.healing.HealContext defines the fields)
    names = {f.name for f in fields(HealContext)}
    if "dense_model" in names:
        extra["dense_model"] = lambda: copy.deepcopy(dense)
    if "labeled" in names:
        train = load_digits(0)["train"]
        extra["labeled"] = (train.images[:n].repeat(1, BUILDERS[kind][1], 1, 1), train.labels[:n])
    ctx = HealContext(model=model, blocks=adapter.blocks(model), entries=entries, masks=masks, images=imgs,
                      batches=in_memory_batches(targets, batch, seed), steps_per_epoch=steps_per_epoch(len(imgs), batch),
                      default_granularity=adapter.default_granularity, **extra)
    return HealCase(model, entries, masks, ctx, targets, before)


@pytest.fixture
def tiny_model():
    return build_model


@pytest.fixture
def heal_case():
    return make_heal_case


@pytest.fixture
def step_graphs(monkeypatch):
    """The StepGraphs of each heal (heal.graph: step), observed: the loop's own class, recording its instances."""
    from tasks.healing import graphed, loop
    made = []

    class Recording(graphed.StepGraphs):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(loop, "StepGraphs", Recording)
    return made


# Real components for tests/e2e/test_cluster_*.py (Ray multi-node, moto S3, PostgreSQL + MLflow server)
from tests.cluster_fixtures import aws_env, mlflow_server, moto_s3, postgres_url  # noqa: E402,F401


@pytest.fixture(autouse=True, scope="session")
def _session_caches(tmp_path_factory):
    """Per-session directories instead of the checkout's .healsweep/: compatibility verdicts
    (orchestrator/spec/verdicts.py; every test session checks each spec in full once) and MLflow store templates
    (orchestrator/tracking/template.py; made from the installed MLflow)."""
    import os

    dirs = {"HEALSWEEP_CHECK_CACHE": "checks", "HEALSWEEP_MLFLOW_TEMPLATES": "mlflow-templates"}
    old = {k: os.environ.get(k) for k in dirs}
    os.environ.update({k: str(tmp_path_factory.mktemp(d)) for k, d in dirs.items()})
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def pytest_collection_modifyitems(config, items):
    """Tests marked ``long`` (minutes each) first, in their order, then the rest in theirs: with pytest-xdist
    (``.ci/test``), work is handed out in collection order, and a long test handed out last would run alone."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
