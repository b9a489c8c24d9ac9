"""Property test of the spec parser (Hypothesis): any mutation of configs/tiny.yaml either parses, and then its
cells can be planned and its sweep.json form parses back to the same spec, or is rejected with a one-line
``SpecError``; never another exception. Derandomized (a fixed example sequence) so CI is reproducible."""
from __future__ import annotations

import copy
import json
import math
from collections import Counter, defaultdict
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.spec.plan import expand_cells, grid_searches
from orchestrator.spec import SpecError, SweepSpec, parse_spec, read_yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = 2000
BASE = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
SECTIONS = {"search": ["trials_per_cell", "lr", "epochs", "objective", "sampler_seed", "startup_trials", "scheduler",
                       "asha_grace_period", "asha_reduction_factor"],
            "heal": ["batch_size", "weight_decay", "lr_min"],
            "resources": ["cpus_per_trial", "gpus_per_trial", "max_concurrent", "cpus_per_dense_task", "max_failures",
                          "reuse_actors"],
            "store": ["shard_size", "dtype", "uri", "budget_gb", "on_budget"],
            "mlflow": ["tracking_uri", "experiment"]}
# every top-level key but `plugins` (it imports the named modules: arbitrary names have no place in a test)
TOP = sorted(set(SweepSpec.__dataclass_fields__) - {"plugins"})
NAMES = ["vit_digits", "resnet_digits", "magnitude", "nm", "corp", "erk", "lamp", "rr", "starfish", "none", "mse",
         "ce", "kl", "crbn", "starfish_kl", "digits", "fifo", "asha", "float16", "main", "mlp_qk", "conv", ""]
SPECIAL = [0, 1, -1, 2**32, 2**64, 10**400, 0.5, 0.9, 1.0, 1e-3, 1e308, -0.0, math.nan, math.inf, -math.inf, True,
           None, "é", "名前", "\x00", " ", "a" * 300, {"name": "nm", "settings": {"n": 2, "m": 4}},
           {"chain": ["none", "mse"]}, {"name": "corp", "models": ["vit_digits"], "scope": "mlp_qk"},
           {"name": "starfish", "settings": {"granularity": "token"}}, [0.5, 0.9], [1.0e-3, 3.0e-3], [1, 3]]

leaves = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2**70), max_value=2**70)
          | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12) | st.sampled_from(NAMES)
          | st.sampled_from(SPECIAL))
keys = st.sampled_from(TOP + [k for ks in SECTIONS.values() for k in ks] + ["name", "settings", "chain"]) | st.text(max_size=6)
values = st.recursive(leaves, lambda c: st.lists(c, max_size=4) | st.dictionaries(keys | st.integers(), c, max_size=4),
                      max_leaves=10)


# values a user plausibly writes for a key (valid or near the edge), so that many mutations still parse
PRUNER_ENTRIES = st.sampled_from(["magnitude", "global", "erk", "lamp", "uniform", {"name": "nm", "settings": {"n": 2, "m": 4}},
                                  {"name": "corp", "models": ["vit_digits"], "scope": "mlp_qk"},
                                  {"name": "magnitude", "sparsities": [0.3, 0.6]}, {"name": "erk", "settings": {"floor": 0.1}}])
HEALER_ENTRIES = st.sampled_from(["starfish", "none", "mse", "kl", "ce", "starfish_kl", {"chain": ["none", "mse"]},
                                  {"name": "starfish", "settings": {"granularity": "example"}},
                                  {"name": "starfish_kl", "settings": {"w_kl": 0.25}}])
fraction = st.floats(0.0, 0.999)
PLAUSIBLE = {
    "sparsities": st.lists(fraction, min_size=1, max_size=4), "calib_sizes": st.lists(st.integers(1, 330), min_size=1, max_size=3),
    "seeds": st.lists(st.integers(0, 2**32), min_size=1, max_size=3), "data_seed": st.integers(-1, 2**32),
    "pruners": st.lists(PRUNER_ENTRIES, min_size=1, max_size=3), "healers": st.lists(HEALER_ENTRIES, min_size=1, max_size=3),
    "models": st.sampled_from([["vit_digits"], ["resnet_digits"], ["vit_digits", "resnet_digits"], ["resnet99"]]),
    "name": st.from_regex(r"[a-z0-9_-]{1,70}", fullmatch=True), "offline": st.booleans(),
    "scope": st.sampled_from([{}, {"vit_digits": "mlp"}, {"vit_digits": "qkv_out_mlp"}, {"vit_digits": "conv"}]),
    "trials_per_cell": st.integers(0, 12_000), "lr": st.lists(st.floats(1e-6, 1.0), min_size=2, max_size=2),
    "epochs": st.lists(st.integers(0, 12_000), min_size=2, max_size=2), "startup_trials": st.none() | st.integers(0, 5),
    "scheduler": st.sampled_from(["fifo", "asha", "pbt"]), "batch_size": st.integers(0, 512),
    "cpus_per_trial": st.floats(0.0, 8.0), "max_failures": st.integers(-1, 5), "reuse_actors": st.booleans(),
    "shard_size": st.integers(0, 256), "dtype": st.sampled_from(["float16", "bfloat16", "float32"]),
    "uri": st.sampled_from(["targets", "/tmp/t", "s3://b/t", "nosuch://x", "", None]),
    "experiment": st.text(max_size=10), "tracking_uri": st.none() | st.sampled_from(["sqlite:///x.db", "file:///tmp/m"]),
}


def value_for(draw, key):
    return draw(PLAUSIBLE[key]) if key in PLAUSIBLE and draw(st.integers(0, 4)) else draw(values)


@st.composite
def mutated_specs(draw):
    d = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["top", "top", "section", "section", "item", "delete", "new"]))
        if how == "top":
            key = draw(st.sampled_from(TOP))
            d[key] = value_for(draw, key)
        elif how == "section":
            sec = draw(st.sampled_from(sorted(SECTIONS)))
            if not isinstance(d.get(sec), dict):
                d[sec] = {}
            key = draw(st.sampled_from(SECTIONS[sec]) | keys)
            d[sec][key] = value_for(draw, key)
        elif how == "item":
            key = draw(st.sampled_from(["models", "sparsities", "calib_sizes", "pruners", "healers", "seeds"]))
            if isinstance(d.get(key), list) and d[key]:
                v = value_for(draw, key)
                d[key][draw(st.integers(0, len(d[key]) - 1))] = v[0] if isinstance(v, list) and v else v
            else:
                d[key] = [draw(values)]
        elif how == "delete" and d:
            d.pop(draw(st.sampled_from(sorted(d))), None)
        else:
            d[draw(keys)] = draw(values)
    return d


def check_property(doc) -> bool:
    """True when ``doc`` parsed (and its plan and round trip held), False when it was rejected properly."""
    try:
        spec = parse_spec(doc)
    except SpecError as e:
        assert "\n" not in str(e) and len(str(e)) < 1000, str(e)[:2000]
        return False
    cells = expand_cells(spec, defaultdict(str))  # the sweep's first stage: plan the cells
    assert cells and set(grid_searches(spec)) >= {c.grid for c in cells}
    assert parse_spec(json.loads(json.dumps(spec.to_dict()))) == spec  # sweep.json parses back (resume, refine)
    return True


def test_tiny_spec_itself_parses():
    assert check_property(copy.deepcopy(BASE))


def test_mutated_specs_parse_or_raise_one_line_spec_error():
    outcomes = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(mutated_specs())
    def run(doc):
        outcomes[check_property(doc)] += 1

    run()
    # both sides of the property were exercised (a generator that only breaks specs would prove little)
    assert outcomes[True] >= EXAMPLES // 10 and outcomes[False] >= EXAMPLES // 2, outcomes


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_yaml_text_loads_or_raises_spec_error(text):
    try:
        read_yaml(text)
    except SpecError as e:
        assert "\n" not in str(e)
