"""The configuration layer: schemas, assembly, checks and preparation of a composed config.

- :mod:`.values`: closed value sets, :class:`ConfigError`, the number checks;
- :mod:`.derive`: schemas derived from signatures (topology presets, cost models, schedule specs);
- :mod:`.schema`: the Hydra schemas, ``register_configs`` and ``compose``;
- :mod:`.assembly`: config -> schedule (by its spec), model shape, segments, cost, topology;
  what the runtime's ranks import;
- :mod:`.checks`: value ranges and combinations, one sentence naming the key;
- :mod:`.prepare`: ``prepare_simulation`` and ``prepare_training``, everything checked
  before any work starts (before any rank is spawned);
- :mod:`.cli`: the apps' command-line helpers.
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
from .checks import check_known_keys, check_logger, data_file_list
from .cli import check_group_choices, check_output_dir, check_overrides, check_run_dir, run_app
from .derive import schedule_schema
from .prepare import SimulationInputs, TrainingInputs, prepare_simulation, prepare_training
from .schema import CONF_DIR, SCHEMAS, compose, register_configs
from .values import BYTE_VOCAB, DATA_FAMILY, MLM_VOCAB, ConfigError

__all__ = [
    "BYTE_VOCAB", "CONF_DIR", "DATA_FAMILY", "MLM_VOCAB", "PLANNED", "SCHEMAS", "ConfigError",
    "SimulationInputs", "TrainingInputs", "branched_schedule", "check_group_choices", "check_output_dir", "check_overrides", "check_run_dir", "run_app", "check_logger", "compose",
    "check_known_keys", "data_file_list", "devices_needed_for", "planned_schedule", "prepare_simulation", "prepare_training",
    "register_configs", "runtime_schedules", "schedule_options", "schedule_schema", "schedule_spec", "segment_lengths",
]
