"""The result file of ``pipecast tune`` (``RUN_DIR/tune.json``) and ``parallel.schedule: tuned``.

``pipecast tune`` writes its whole result (``{"measured", "candidates", "best", "verified", "tuned_for"}``) to
``RUN_DIR/tune.json``.  A config with ``parallel.schedule: tuned`` is resolved by :func:`resolve_tuned` at the entry
points (``pipecast train`` after loading the config; a program that builds a trainer itself calls it): the ``parallel.*`` settings of ``best`` replace ``schedule``, ``virtual``,
``microbatch_group_size_per_vp_stage`` and ``max_in_flight`` (the last two must not be set beside ``tuned``), after
checking that the result was measured for the same model, pipeline and batch (``tuned_for``); the resolved config
is validated, errors naming the file.  The run saves the resolved config (the concrete schedule) as
``RUN_DIR/config.yaml``.  ``--resume`` with ``tuned`` resolves it again, so a newer tune result may change the
schedule of a resumed run; that is safe, as checkpoints do not depend on the pipeline layout.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ...plan.registry import schedule_names
from ..config import ConfigError, validate
from ..config.layout import has_overlap_cells

__all__ = ["TUNE_FILE", "tune_path", "tuned_for", "check_tuned_for", "read_result", "resolve_tuned"]

TUNE_FILE = "tune.json"
_TUNED_FIELDS = ("schedule", "virtual", "microbatch_group_size_per_vp_stage", "max_in_flight", "schedule_costs")


def tune_path(config) -> Path:
    """``logging.run_dir / tune.json``."""
    return Path(config.logging.run_dir) / TUNE_FILE


def tuned_for(config) -> dict:
    """The settings a tune result depends on (everything but the tuned ``parallel.*`` fields): model, pipeline and
    data sizes, device, microbatch size and count."""
    p, s = config.parallel, config.training
    return {**{f"model.{k}": v for k, v in dataclasses.asdict(config.model).items()},
            "parallel.pipeline": p.pipeline, "parallel.data": config.data_parallel_size, "parallel.device": p.device,
            "training.micro_batch_size": s.micro_batch_size, "training.num_microbatches": s.num_microbatches}


def check_tuned_for(saved, config, what: str) -> None:
    """Raise ``ConfigError`` (starting with ``what``, naming the first differing field) unless ``saved`` equals
    :func:`tuned_for` of ``config``."""
    if not isinstance(saved, dict):
        raise ConfigError(f"{what} has no 'tuned_for' settings; re-run `pipecast tune CONFIG`")
    now = json.loads(json.dumps(tuned_for(config)))
    for key, value in now.items():
        if saved.get(key) != value:
            raise ConfigError(f"{what} was measured with {key}={saved.get(key)!r}, this config has {value!r}; re-run "
                              f"`pipecast tune CONFIG` for these settings")


def read_result(path: str | Path) -> dict:
    """A tune result file (JSON); ``ConfigError`` if it is missing or not one."""
    try:
        result = json.loads(Path(path).read_text())
        if not isinstance(result, dict) or not {"measured", "best", "tuned_for"} <= result.keys():
            raise ValueError("it has no 'measured', 'best' and 'tuned_for' entries")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not a pipecast tune result ({exc}); re-run `pipecast tune CONFIG`") from None
    return result


def _best_fields(best, where: str) -> dict:
    """The ``parallel.*`` fields of a result's ``best`` entry, type-checked (``ConfigError`` naming ``where``)."""
    if best is None:
        raise ConfigError(f"{where} recommends no schedule: no candidate fitted its --memory-budget-gib; re-run "
                          f"`pipecast tune` with a larger budget, or set parallel.schedule to a schedule name")
    settings = best.get("settings") if isinstance(best, dict) else None
    if not isinstance(settings, dict):
        raise ConfigError(f"{where}: its 'best' entry has no 'settings'; re-run `pipecast tune CONFIG`")
    fields = {f: settings.get(f"parallel.{f}") for f in _TUNED_FIELDS}
    names = list(schedule_names())
    if fields["schedule"] not in names:
        raise ConfigError(f"{where}: its best has parallel.schedule={fields['schedule']!r}, not one of {names}; "
                          f"re-run `pipecast tune CONFIG`")
    costs = fields["schedule_costs"]
    if costs is not None and not isinstance(costs, str):
        raise ConfigError(f"{where}: its best has parallel.schedule_costs={costs!r}, which must be a string or null; "
                          f"re-run `pipecast tune CONFIG`")
    for f in _TUNED_FIELDS[1:-1]:
        value, optional = fields[f], f != "virtual"
        if not (value is None and optional) and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{where}: its best has parallel.{f}={value!r}, which must be an integer >= 1"
                              f"{' or null' if optional else ''}; re-run `pipecast tune CONFIG`")
    return fields


def tuned_overlap(config, schedule: str, virtual: int, group_size: int | None = None,
                  max_in_flight: int | None = None) -> bool:
    """Whether a run of ``schedule`` chosen for ``config`` by ``pipecast tune`` keeps
    ``parallel.overlap_moe_expert_parallel_comm``: the config sets it and the schedule's plan built without the
    option has forward-backward cells -- DualPipeV's.  Interleaved 1F1B's combined cells exist only with the option:
    a candidate ranked with them says so in its settings (:attr:`engine.plan.candidates.Candidate.overlap`), one
    without them runs as predicted: without."""
    p = config.parallel
    if not (p.overlap_moe_expert_parallel_comm and has_overlap_cells(schedule, p.pipeline)):
        return False
    from ...plan.build import build_plan
    return bool(build_plan(schedule, p.pipeline, config.training.num_microbatches, virtual, group_size,
                           max_in_flight=max_in_flight).compounds)


def resolve_tuned(config):
    """``config`` with ``parallel.schedule: tuned`` replaced by the best candidate of ``RUN_DIR/tune.json``
    (any other config is returned as it is).

    Raises:
        ConfigError: ``max_in_flight`` or ``microbatch_group_size_per_vp_stage`` set beside ``tuned``; no tune
            result in the run folder, an unreadable one, one measured for other settings (the message names the
            first differing field and says to re-run ``pipecast tune``), one recommending nothing or a setting
            that is not valid for this config.
    """
    if config.parallel.schedule != "tuned":
        return config
    path, p = tune_path(config), config.parallel
    for name in ("max_in_flight", "microbatch_group_size_per_vp_stage", "schedule_costs"):
        if getattr(p, name) is not None:
            raise ConfigError(f"parallel.{name}={getattr(p, name)} is set together with parallel.schedule=tuned, "
                              f"which takes it from {path}; remove it, or name the schedule instead of tuned")
    if not path.is_file():
        raise ConfigError(f"parallel.schedule=tuned reads {path}, which does not exist: run `pipecast tune CONFIG` "
                          f"with this logging.run_dir first (it writes the recommendation there), or set "
                          f"parallel.schedule to a schedule name")
    where = f"parallel.schedule=tuned: {path}"
    result = read_result(path)
    check_tuned_for(result["tuned_for"], config, where)
    fields = _best_fields(result["best"], where)
    if p.overlap_moe_expert_parallel_comm:  # the MoE overlap as the tuner predicted the best schedule
        cells = result["best"]["settings"].get("parallel.overlap_moe_expert_parallel_comm") is True  # combined 1F1B
        fields["overlap_moe_expert_parallel_comm"] = cells or tuned_overlap(
            config, fields["schedule"], fields["virtual"], fields["microbatch_group_size_per_vp_stage"],
            fields["max_in_flight"])
    tuned = dataclasses.replace(config, parallel=dataclasses.replace(p, **fields))
    try:
        validate(tuned)  # the whole run again (cheap): the trainer then takes it as validated
    except (ConfigError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"{where}: its best ({fields}) is not valid for this config: {exc}") from None
    return tuned
