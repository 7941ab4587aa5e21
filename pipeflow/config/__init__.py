"""The configuration layer: schemas, assembly, checks and preparation of a composed config.

- :mod:`.values`: :class:`ConfigError`, where conf/ is, the number checks every group uses;
- :mod:`.groups`: one module per config group (pipeline, model, data, optim, runtime,
  trainer, logger) and per top-level key with rules (precision, resume), each with its
  dataclass, value sets and checks together;
- :mod:`.derive`: schemas derived from signatures (topology presets, cost models, schedule specs);
- :mod:`.schema`: the Hydra schemas, ``register_configs`` and ``compose``;
- :mod:`.assembly`: config -> schedule (by its spec), model shape, segments, cost, topology;
  what the runtime's ranks import;
- :mod:`.checks`: the check that spans the groups (no key a schema lacks);
- :mod:`.resolved`: what a config resolves to (schedule, shape, degrees, topology,
  precision, segments), decided once per preparation;
- :mod:`.prepare`: ``prepare_simulation`` and ``prepare_training``, everything checked
  before any work starts (before any rank is spawned);
- :mod:`.to_runplan`: a checked train config -> the run plan the ranks instantiate;
- :mod:`.command_line`: the apps' command-line helpers.
"""

from .assembly import (
    PLANNED,
    branched_schedule,
    devices_needed_for,
    planned_schedule,
    runtime_schedules,
    schedule_options,
    schedule_spec,
    segment_lengths,
)
from .checks import check_known_keys
from .command_line import (check_group_choices, check_output_dir, check_overrides, check_run_dir, drop_empty_run_dir,
                           run_app, save_hydra_config)
from .derive import schedule_schema
from .groups.data import DATA_FAMILY, data_file_list
from .groups.logger import check_logger
from .groups.model import RECOMPUTE, resolve_model
from .groups.precision import PRECISIONS, resolve_precision
from .prepare import SimulationInputs, TrainingInputs, prepare_simulation, prepare_training
from .schema import CONF_DIR, SCHEMAS, compose, register_configs
from .values import BYTE_VOCAB, MLM_VOCAB, ConfigError, at_least, naming_key, number

__all__ = [
    "BYTE_VOCAB", "CONF_DIR", "DATA_FAMILY", "MLM_VOCAB", "PLANNED", "PRECISIONS", "RECOMPUTE", "SCHEMAS", "ConfigError",
    "SimulationInputs", "TrainingInputs", "at_least", "branched_schedule", "check_group_choices", "check_known_keys",
    "check_logger", "check_output_dir", "check_overrides", "check_run_dir", "compose", "data_file_list",
    "drop_empty_run_dir",
    "save_hydra_config",
    "devices_needed_for", "naming_key", "number", "planned_schedule", "prepare_simulation", "prepare_training",
    "register_configs", "resolve_model", "resolve_precision", "run_app", "runtime_schedules", "schedule_options",
    "schedule_schema", "schedule_spec", "segment_lengths",
]
