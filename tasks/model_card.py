"""The model card of an export, as text: ``model_card.md`` from the card's fields, and the plain Python in it.

No torch and no project import: the card is a dict that ``tasks/export.py`` fills from the trial's record and its
MLflow run. The Markdown names which trial made the weights (sweep, grid, cell, stage, seeds, mask), how they were
healed (a closed-form healer's card prints no training settings), the sparsity over the pruning scope and over the
whole model, the sha256 of the exported weight files, and how this run's accuracy relates to the report's number
for its cell.
"""
from __future__ import annotations

import ast
import json
from typing import Any, Mapping


def parse_settings(value: Any) -> Any:
    """A settings MLflow param (``str(dict)``, e.g. ``"{'allocation': 'erk'}"``) -> the dict; a dict as is; a
    string that is not a Python literal stays the string (never a guess)."""
    if not isinstance(value, str):
        return value
    try:
        out = ast.literal_eval(value)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return value
    return out if isinstance(out, dict) else value


def settings_text(value: Any) -> str:
    """``{'allocation': 'erk', 'n': 2}`` -> ``allocation=erk, n=2``; empty or missing -> ``""``."""
    if not value:
        return ""
    if isinstance(value, dict):
        return ", ".join(f"{k}={json.dumps(v) if isinstance(v, (dict, list)) else v}" for k, v in value.items())
    return str(value)


def _merge(*codes: str) -> str:
    """Python snippets -> one program: their leading import lines first (deduplicated), then their bodies."""
    imports, bodies = [], []
    for code in codes:
        lines = code.strip("\n").splitlines()
        n = next((i for i, ln in enumerate(lines) if not ln.startswith(("import ", "from ")) and ln.strip()),
                 len(lines))
        imports += [ln for ln in lines[:n] if ln.strip()]
        bodies.append("\n".join(lines[n:]).strip("\n"))
    head = sorted(set(imports), key=lambda ln: (ln.startswith("from "), ln))
    return "\n".join(head) + "\n\n\n" + "\n\n".join(b for b in bodies if b) + "\n"


def card_code(card: Mapping[str, Any]) -> str:
    """Python that rebuilds the healed model from model.safetensors and, for the digits, reproduces the logged
    evaluation accuracy (run it in the export directory; it imports no healsweep module)."""
    load = ("from safetensors.torch import load_file\n"
            'model.load_state_dict(load_file("model.safetensors"))\nmodel.eval()')
    if card["evaluation"]["indices"] is None:  # real datasets: the transform only
        return _merge(card["reload"]["code"], load, card["preprocessing"]["code"])
    prep = card["preprocessing"]["code"].replace(
        "EVAL_INDICES", 'json.load(open("model_card.json"))["evaluation"]["indices"]')
    evaluate = ("import json\nimport torch\nwith torch.no_grad():  # batches of 256, as the trial evaluated\n"
                "    pred = torch.cat([model(images[i:i + 256]).argmax(1) for i in range(0, len(images), 256)])\n"
                "accuracy = (pred == labels).float().mean().item()\n"
                f"print(f\"healed top-1 {{accuracy:.4f}} (logged: {card['accuracy']['healed_acc']:.4f})\")")
    return _merge(card["reload"]["code"], load, prep, evaluate)


def _pct(v) -> str:
    return "n/a" if v is None else f"{100 * float(v):.2f}%"


def _origin_lines(card: Mapping[str, Any]) -> list[str]:
    """Which trial made the weights: enough to find it again, and to heal a re-evaluation again."""
    stage = {"search": "a search trial", None: "a trial (its stage not recorded)",
             "reevaluate": "a re-evaluation of its cell's search winner on a fresh healing seed"}.get(
        card.get("stage"), f"stage {card.get('stage')}")
    seeds = f"seed {card['seed']} (the cell's: its mask)"
    if card.get("heal_seed") is not None:
        seeds += f", healing seed {card['heal_seed']} (batch order and initialisation of this re-evaluation)"
    else:
        seeds += ", also the healing seed"
    return [f"- made by: MLflow run `{card['mlflow_run_id']}`, trial `{card['trial_id']}`, {stage}"
            + (f" (Optuna trial {card['optuna_trial']})" if card.get("optuna_trial") is not None else ""),
            f"- sweep `{card.get('sweep_id')}`, grid `{card.get('grid')}`, cell `{card.get('cell_id')}`; {seeds}",
            f"- mask: key `{card.get('mask_key')}`, digest `{card.get('mask_digest')}` (what it prunes: names, "
            "shapes and kept entries)"]


def _method_lines(card: Mapping[str, Any]) -> list[str]:
    pruner = settings_text(card.get("pruner_settings"))
    healer = settings_text(card.get("healer_settings"))
    scope = (f"- pruner: {card['pruner']}" + (f" ({pruner})" if pruner else "") + f", scope {card['scope']}: "
             f"sparsity {card['sparsity']} over the pruning scope (achieved {card['achieved_sparsity']:.4f})")
    if card.get("zero_fraction") is not None:
        scope += f"; zero weights in the whole model: {100 * card['zero_fraction']:.1f}% of its parameters"
    heal = f"- healer: {card['healer']}" + (f" ({healer})" if healer else "") \
        + (f" (granularity used: {card['granularity']})" if card.get("granularity") else "")
    if card.get("closed_form"):
        heal += ": closed form, no gradient training (no learning rate, epochs or batch size used)"
    else:
        epochs = f"{card['epochs']} epoch{'' if card['epochs'] == 1 else 's'}"
        heal += (f", lr {card['lr']:.3g}, " + (f"{card['steps']} steps ({epochs})" if card.get("steps") else epochs)
                 + f", batch {card['batch_size']}")
    return [scope, heal]


def _accuracy_lines(card: Mapping[str, Any]) -> list[str]:
    acc = card["accuracy"]
    lines = [f"- accuracy of this run alone (evaluation split): dense {_pct(acc['dense_acc'])}, pruned "
             f"{_pct(acc['pruned_acc'])}, healed {_pct(acc['healed_acc'])}, retention {_pct(acc['retention'])}"]
    rep = card.get("report")
    if rep:
        ids = rep["run_ids"]
        among = "this run among them" if card["mlflow_run_id"] in ids else "not this run"
        lines.append(f"- the report's healed number for cell `{card.get('cell_id')}`: {_pct(rep['healed_acc'])}, "
                     + ("this run's own" if ids == [card["mlflow_run_id"]] else
                        f"the mean over {len(ids)} run{'' if len(ids) == 1 else 's'} ({among}): "
                        + ", ".join(f"`{i}`" for i in ids)))
    return lines


def card_markdown(card: Mapping[str, Any]) -> str:
    lines = [
        f"# {card['model']}: pruned with {card['pruner']}, healed with {card['healer']}", "",
        *_origin_lines(card),
        f"- source: `{json.dumps(card['source'], default=str)}` (weights digest `{card['model_digest']}`)",
        *_method_lines(card),
        f"- calibration: {card['calib_size']} images, digest `{card['calib_digest']}`; evaluation digest "
        f"`{card['eval_digest']}`; dataset `{json.dumps(card['dataset'], default=str)}` (split seed {card['data_seed']}"
        + (f", calibration draw {card['calib_seed']})" if card.get("calib_seed") else ")"),
        f"- preprocessing: `{card['preprocessing']['transform']}`",
        *_accuracy_lines(card),
    ]
    if card["metrics"]:
        lines.append("- logged metrics: " + ", ".join(f"{k} {v:.6g}" for k, v in sorted(card["metrics"].items())))
    lines += ["- files (sha256): " + ", ".join(f"`{n}` {h}" for n, h in sorted(card.get("files", {}).items())), "",
              "## Load" + (" and evaluate" if card["evaluation"]["indices"] is not None else ""), "",
              "Plain timm/torchvision code (no healsweep import); run it in this directory.", "",
              "```python", card_code(card).rstrip("\n"), "```", ""]
    return "\n".join(lines)
