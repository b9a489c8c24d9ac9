"""Read a sweep's trial runs back from MLflow into typed pandas frames.

Only MLflow is read: every number in the returned frames is a value the orchestrator logged
(params are parsed from their string form, metrics are MLflow's latest value per key).
No tracking URI or experiment is set globally: a private ``MlflowClient`` is used.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

__all__ = [
    "STR_COLUMNS",
    "FLOAT_PARAM_COLUMNS",
    "INT_COLUMNS",
    "METRIC_COLUMNS",
    "load_trials",
    "best_per_cell",
    "stage_of",
    "cell_list",
    "load_sweep_info",
    "grid_names",
    "is_nm",
    "pattern_sort_key",
    "pattern_sparsity",
]

ROLE_TAG = "healsweep.role"

# Identity columns (tags, run info and string params).
STR_COLUMNS = (
    "run_id", "experiment_id", "status", "cell_id", "trial_id", "store_key", "pattern",
    "model", "pruner", "scope", "healer", "granularity", "failure_reason", "mask_key", "grid", "model_digest", "stage",
    "precision", "mask_digest", "pruner_settings", "healer_settings",
    "boundary_tag",  # the run's search_boundary tag as a report left it ("true" / "false"): search_space.flag_boundary
)
_TAG_COLUMNS = ("cell_id", "trial_id", "store_key", "pattern", "failure_reason", "mask_key", "stage")
_STR_PARAMS = ("model", "pruner", "scope", "healer", "granularity", "grid", "model_digest",  # digest: the weights' sha256
               "precision",  # heal.precision (fp32, tf32, bf16)
               "mask_digest",  # the mask's content (differs between seeds where the mask depends on the seed)
               "pruner_settings", "healer_settings")  # resolved settings, as logged: two entries of one method
FLOAT_PARAM_COLUMNS = ("sparsity", "lr")
# nullable Int64; calib_seed: a re-evaluation's calibration draw (search.calib_draws), <NA>: the sweep's own
INT_COLUMNS = ("calib_size", "epochs", "batch_size", "seed", "optuna_trial", "steps", "heal_seed", "calib_seed")
# The search objectives and their direction (orchestrator/spec/checks.py OBJECTIVES; docs/methods.md#search).
OBJECTIVE_MODES = {"selection_acc": "max", "heldout_align": "min"}
METRIC_COLUMNS = (
    "dense_acc", "pruned_acc", "healed_acc", "retention", "heal_seconds",
    "dense_forward_images", "mask_violations", "achieved_sparsity", "selection_acc", "train_loss",
)
FAILED_STATUSES = ("FAILED", "KILLED")


def stage_of(trials: pd.DataFrame) -> pd.Series:
    """Each trial's ``stage`` ("search" or "reevaluate"); trials of sweeps before the tag are search trials."""
    if "stage" not in trials.columns:
        return pd.Series("search", index=trials.index)
    return trials["stage"].astype("object").fillna("search").astype(str)


def cell_list(cells: pd.DataFrame, detail=None, limit: int = 6, sep: str = ", ") -> str:
    """'magnitude/starfish 0.95 n=64 seed 0 (DETAIL), … and 3 more': the first ``limit`` cells (rows with pruner,
    healer, pattern, calib_size, seed), each followed by ``detail(row)`` in parentheses when given."""
    names = [f"{r.pruner}/{r.healer} {r.pattern} n={r.calib_size} seed {r.seed}"
             + (f" ({detail(r)})" if detail else "") for r in cells.head(limit).itertuples(index=False)]
    more = f" and {len(cells) - limit} more" if len(cells) > limit else ""
    return sep.join(names) + more


def _quote(value: str) -> str:
    """Quote a value for an MLflow filter string."""
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise ValueError(f"cannot quote {value!r} for an MLflow filter string")


def _search(client: MlflowClient, experiment_id: str, filter_string: str) -> list:
    runs, token = [], None
    while True:
        page = client.search_runs(
            [experiment_id], filter_string=filter_string, run_view_type=ViewType.ACTIVE_ONLY,
            max_results=1000, page_token=token,
        )
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _empty_frame(extra_metrics: tuple[str, ...] = ()) -> pd.DataFrame:
    return _typed(pd.DataFrame({c: [] for c in _column_order(extra_metrics)}), extra_metrics)


def _column_order(extra_metrics: tuple[str, ...]) -> list[str]:
    return [*STR_COLUMNS, *FLOAT_PARAM_COLUMNS, *INT_COLUMNS, *METRIC_COLUMNS, *extra_metrics]


def _to_int(series: pd.Series) -> pd.Series:
    num = pd.to_numeric(series, errors="coerce").astype("float64")
    integral = num.where(np.isfinite(num) & (num == np.round(num)))
    return integral.astype("Int64")


def _typed(df: pd.DataFrame, extra_metrics: tuple[str, ...]) -> pd.DataFrame:
    out = pd.DataFrame(index=df.index)
    for c in STR_COLUMNS:
        out[c] = pd.Series(df[c].tolist(), index=df.index, dtype="str")
    for c in FLOAT_PARAM_COLUMNS:
        out[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
    for c in INT_COLUMNS:
        out[c] = _to_int(df[c])
    for c in (*METRIC_COLUMNS, *extra_metrics):
        out[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
    return out.reset_index(drop=True)


def load_trials(tracking_uri: str, sweep_id: str, experiment: str = "healsweep",
                cell_id: str | None = None) -> pd.DataFrame:
    """One row per trial run (tag ``healsweep.role`` = "trial") of ``sweep_id`` (of its cell ``cell_id`` alone
    when given: what ``healsweep export`` reads for one card).

    Columns: see ``STR_COLUMNS`` (str, NaN when the tag/param is absent), ``FLOAT_PARAM_COLUMNS``
    (float64), ``INT_COLUMNS`` (nullable Int64, <NA> when absent), ``METRIC_COLUMNS`` plus any other
    logged metric (float64, NaN when absent; MLflow's latest value, i.e. the one at the highest step).
    Deleted runs are ignored; runs of any status are returned.
    """
    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return _empty_frame()
    filt = f"tags.sweep_id = {_quote(sweep_id)} and tags.`{ROLE_TAG}` = 'trial'"
    if cell_id is not None:
        filt += f" and tags.cell_id = {_quote(cell_id)}"
    records = []
    for run in _search(client, exp.experiment_id, filt):
        tags, params = run.data.tags, run.data.params
        rec = {"run_id": run.info.run_id, "experiment_id": run.info.experiment_id,
               "status": run.info.status}
        rec.update({c: tags.get(c) for c in _TAG_COLUMNS}, boundary_tag=tags.get("search_boundary"))
        rec.update({c: params.get(c) for c in (*_STR_PARAMS, *FLOAT_PARAM_COLUMNS, *INT_COLUMNS)})
        rec.update({f"metric:{k}": v for k, v in run.data.metrics.items()})
        records.append(rec)
    extra = tuple(sorted({k[7:] for r in records for k in r if k.startswith("metric:")}
                         - set(METRIC_COLUMNS) - set(_column_order(()))))
    if not records:
        return _empty_frame()
    raw = pd.DataFrame.from_records(
        [{(k[7:] if k.startswith("metric:") else k): v for k, v in r.items()} for r in records])
    for c in _column_order(extra):
        if c not in raw.columns:
            raw[c] = None
    df = _typed(raw, extra)
    return df.sort_values(["cell_id", "trial_id", "run_id"], na_position="last",
                          ignore_index=True)


def best_per_cell(trials: pd.DataFrame, objective: str = "selection_acc") -> pd.DataFrame:
    """Best FINISHED trial of every cell, chosen by the sweep's search ``objective`` (never ``healed_acc``):
    the highest ``selection_acc``, or the lowest ``heldout_align`` (label-free, docs/methods.md#search).

    Ties on the objective go to the fewer ``steps`` (a steps-based search), then ``epochs`` (the cheaper trial),
    then the lower ``optuna_trial`` number (the one found first), then ``run_id``: deterministic, so the same
    trials always give the same pick (wall-clock ``heal_seconds`` would not). Runs without the objective rank
    last. Adds ``n_trials`` (all search runs of the cell, any status) and ``n_failed`` (status FAILED or KILLED).
    Re-evaluations (tag ``stage`` = reevaluate) are ignored: ``analysis.reported`` quotes them.
    Cells without a finished run are absent.
    """
    if objective not in OBJECTIVE_MODES:
        raise ValueError(f"objective must be one of {', '.join(OBJECTIVE_MODES)}, got {objective!r}")
    if objective not in trials.columns:
        trials = trials.assign(**{objective: float("nan")})
    trials = trials[stage_of(trials) != "reevaluate"]  # re-evaluations of a winner are not candidates
    counts = trials.dropna(subset=["cell_id"]).groupby("cell_id", sort=True).agg(
        n_trials=("run_id", "size"),
        n_failed=("status", lambda s: int(s.isin(FAILED_STATUSES).sum())),
    )
    done = trials[(trials["status"] == "FINISHED") & trials["cell_id"].notna()]
    cost = ["steps", "epochs"] if "steps" in done.columns else ["epochs"]  # the cheaper trial first
    ranked = done.sort_values(
        ["cell_id", objective, *cost, "optuna_trial", "run_id"],
        ascending=[True, OBJECTIVE_MODES[objective] == "min", *[True] * len(cost), True, True], na_position="last",
    )
    best = ranked.drop_duplicates("cell_id", keep="first")
    best = best.merge(counts, left_on="cell_id", right_index=True, how="left")
    best["n_trials"] = best["n_trials"].astype("int64")
    best["n_failed"] = best["n_failed"].astype("int64")
    return best.reset_index(drop=True)


def at_config(rows: pd.DataFrame, key: pd.DataFrame) -> pd.DataFrame:
    """The ``rows`` whose lr and length (``key``'s columns) equal their cell's row of ``key`` (indexed by cell id);
    two missing values count as equal."""
    same = pd.Series(True, index=rows.index)
    for c in key.columns:
        w = rows["cell_id"].map(key[c])
        same &= (rows[c] == w) | (rows[c].isna() & w.isna())
    return rows[same.fillna(False).astype(bool)]


def quoted_per_cell(trials: pd.DataFrame, objective: str = "selection_acc") -> pd.DataFrame:
    """``best_per_cell``, except that a cell with re-evaluations gets, as its winner, its best search trial at the
    configuration they healed again (lr and length of its latest re-evaluation, by ``optuna_trial``): under
    ``search.converge`` the design quotes the centre of the cell's best plateau of ties, which need not be its best
    draw (orchestrator/search/pick.py); the fixed designs re-evaluate the best draw itself (the same row). A cell
    whose re-evaluated configuration no search trial holds keeps ``best_per_cell``'s row."""
    best = best_per_cell(trials, objective)
    cols = [c for c in ("lr", "steps", "epochs") if c in trials.columns]
    if best.empty or "stage" not in trials.columns or "lr" not in cols:
        return best
    stage = stage_of(trials)
    done = trials["status"] == "FINISHED"
    again = trials[(stage == "reevaluate") & done & trials["cell_id"].notna()]
    if again.empty:
        return best
    order = pd.to_numeric(again["optuna_trial"], errors="coerce") if "optuna_trial" in again.columns else 0
    last = again.assign(_n=order).sort_values(["cell_id", "_n"]).drop_duplicates("cell_id", keep="last")
    key = last.set_index("cell_id")[cols]
    search = trials[(stage != "reevaluate") & trials["cell_id"].isin(key.index)]
    at = best_per_cell(at_config(search, key), objective)  # (cells re-evaluated, the quoted row)
    if at.empty:
        return best
    keep = best.set_index("cell_id")[["n_trials", "n_failed"]]
    at = at.drop(columns=["n_trials", "n_failed"]).join(keep, on="cell_id")
    out = pd.concat([best[~best["cell_id"].isin(at["cell_id"])], at], ignore_index=True)
    return out.sort_values("cell_id", kind="stable").reset_index(drop=True)


def load_sweep_info(tracking_uri: str, sweep_id: str, experiment: str = "healsweep",
                    parent_run_id: str | None = None) -> dict:
    """``{"name", "run_id", "experiment_id", "objective", "calib_seed", "partial", "status", "diagnostics"}`` of the
    sweep's parent run (values None if absent; ``objective``: the parent run's ``objective`` param, "selection_acc"
    when absent; ``calib_seed``: its param, 0 when absent (the data seed's calibration order); ``partial``: None, or
    for a sweep interrupted (tag ``partial=true``) ``{"finished", "planned", "signal"}`` from its tags, ``planned``
    None when it stopped before its trials were planned; ``status``: the run's MLflow status, RUNNING while a driver
    runs the sweep or after one stopped without ending it; ``diagnostics``: the models whose RR diagnostics it logged, from its
    ``diagnostics_key.<model>`` tags, set with the artifact).
    ``parent_run_id`` (sweep.json's): that one first, should a stray second parent run of the sweep exist (a start or
    a repair cut short: healsweep doctor deletes it)."""
    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    info = {"name": None, "run_id": None, "objective": "selection_acc", "calib_seed": 0, "partial": None,
            "status": None, "experiment_id": exp.experiment_id if exp is not None else None, "diagnostics": []}
    if exp is None:
        return info
    filt = f"tags.sweep_id = {_quote(sweep_id)} and tags.`{ROLE_TAG}` = 'sweep'"
    parents = sorted(_search(client, exp.experiment_id, filt), key=lambda r: r.info.run_id != parent_run_id)
    if parents:
        run = parents[0]
        info["name"] = run.info.run_name or run.data.tags.get("mlflow.runName")
        info["run_id"], info["status"] = run.info.run_id, run.info.status
        info["objective"] = run.data.params.get("objective", "selection_acc")
        info["calib_seed"] = int(run.data.params.get("calib_seed", 0))
        tags = run.data.tags
        info["diagnostics"] = sorted(k[len("diagnostics_key."):] for k in tags if k.startswith("diagnostics_key."))
        if tags.get("partial") == "true":
            info["partial"] = {"finished": tags.get("trials_finished", "?"), "planned": tags.get("trials_planned") or None,
                               "signal": tags.get("interrupted_by") or "a signal"}
    return info


def grid_names(best: pd.DataFrame) -> pd.Series:
    """The grid of each row: the logged ``grid`` param, "main" when absent (sweeps before grids)."""
    g = best["grid"] if "grid" in best.columns else pd.Series(index=best.index, dtype="object")
    ok = g.notna() & ~g.astype(str).isin(("", "nan", "None"))
    return g.astype("object").where(ok, "main").astype(str)


def grid_order(names) -> list[str]:
    """The distinct grid names, "main" first, then by name (the order every report section lists grids in)."""
    return sorted(set(names), key=lambda g: (g != "main", g))


def pattern_sparsity(pattern: str) -> float:
    """Nominal sparsity of a pattern tag: "0.9" -> 0.9, "2:4" -> 0.5; NaN when unparseable."""
    text = str(pattern).strip()
    if ":" in text:
        try:
            n, m = (int(x) for x in text.split(":"))
        except ValueError:
            return math.nan
        return 1.0 - n / m if m > 0 else math.nan
    try:
        return float(text)
    except ValueError:
        return math.nan


def is_nm(pattern: str) -> bool:
    return ":" in str(pattern) and not math.isnan(pattern_sparsity(pattern))


def pattern_sort_key(pattern: str) -> tuple:
    """Numeric sparsities ascending first, then N:M patterns (by sparsity), then anything else."""
    s = pattern_sparsity(pattern)
    if math.isnan(s):
        return (2, 0.0, str(pattern))
    return (1 if is_nm(pattern) else 0, s, str(pattern))
