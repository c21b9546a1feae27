"""The result file of ``pipecast tune`` (``RUN_DIR/tune.json``) and ``parallel.schedule: tuned``.

``pipecast tune`` writes its whole result (``{"measured", "candidates", "best", "verified", "tuned_for"}``) to
``RUN_DIR/tune.json``.  A config with ``parallel.schedule: tuned`` is resolved by :func:`resolve_tuned` when it is
loaded: the ``parallel.*`` settings of ``best`` replace ``schedule``, ``virtual``,
``microbatch_group_size_per_vp_stage`` and ``max_in_flight``, after checking that the result was measured for the
same model, pipeline and batch (``tuned_for``).  The run saves the resolved config (the concrete schedule) as
``RUN_DIR/config.yaml``.  ``--resume`` with ``tuned`` resolves it again, so a newer tune result may change the
schedule of a resumed run; that is safe, as checkpoints do not depend on the pipeline layout.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

__all__ = ["TUNE_FILE", "tune_path", "tuned_for", "check_tuned_for", "read_result", "resolve_tuned"]

TUNE_FILE = "tune.json"
_TUNED_FIELDS = ("schedule", "virtual", "microbatch_group_size_per_vp_stage", "max_in_flight")


def tune_path(config) -> Path:
    """``logging.run_dir / tune.json``."""
    return Path(config.logging.run_dir) / TUNE_FILE


def tuned_for(config) -> dict:
    """The settings a tune result depends on (everything but the tuned ``parallel.*`` fields): model, pipeline and
    data sizes, device, microbatch size and count."""
    p, s = config.parallel, config.schedule
    return {"model": dataclasses.asdict(config.model), "parallel.pipeline": p.pipeline, "parallel.data": config.data_parallel_size,
            "parallel.device": p.device, "schedule.micro_batch_size": s.micro_batch_size,
            "schedule.num_microbatches": s.num_microbatches}


def check_tuned_for(saved: dict, config, what: str) -> None:
    """Raise ``ConfigError`` (starting with ``what``) unless ``saved`` equals :func:`tuned_for` of ``config``."""
    from .config import ConfigError
    now = json.loads(json.dumps(tuned_for(config)))
    for key, value in now.items():
        if saved.get(key) != value:
            raise ConfigError(f"{what} was measured with {key}={saved.get(key)!r}, this config has {value!r}; re-run "
                              f"`pipecast tune CONFIG` for these settings")


def read_result(path: str | Path) -> dict:
    """A tune result file (JSON); ``ConfigError`` if it is missing or not one."""
    from .config import ConfigError
    try:
        result = json.loads(Path(path).read_text())
        if not isinstance(result, dict) or not {"measured", "best", "tuned_for"} <= result.keys():
            raise ValueError("it has no 'measured', 'best' and 'tuned_for' entries")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not a pipecast tune result ({exc}); re-run `pipecast tune CONFIG`") from None
    return result


def resolve_tuned(config):
    """``config`` with ``parallel.schedule: tuned`` replaced by the best candidate of ``RUN_DIR/tune.json``.

    Raises:
        ConfigError: no tune result in the run folder, an unreadable one, or one measured for other settings (the
            message names the first differing field and says to re-run ``pipecast tune``).
    """
    from .config import ConfigError
    path = tune_path(config)
    if not path.is_file():
        raise ConfigError(f"parallel.schedule=tuned reads {path}, which does not exist: run `pipecast tune CONFIG` "
                          f"first (it writes the best schedule there), or set parallel.schedule to a schedule name")
    result = read_result(path)
    best, saved = result["best"]["settings"], result["tuned_for"]
    check_tuned_for(saved, config, f"parallel.schedule=tuned: {path}")
    fields = {f: best.get(f"parallel.{f}") for f in _TUNED_FIELDS}
    fields["virtual"] = fields["virtual"] or 1
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, **fields))
