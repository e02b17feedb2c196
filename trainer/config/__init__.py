"""Run configuration: `sections` (one pydantic model per component, composed into `TrainConfig`),
`settings` (the Watch's `WatchSettings`), `load` (TOML, `--set` overrides, variants) and `legacy`
(renamed keys still read). Everything is importable from here."""

from spikewatch.trainer.config.load import (
    CONFIG_DIR,
    VARIANT_DIR,
    apply_overrides,
    apply_variants,
    find_config,
    load_config,
    validate_config,
    variant_names,
)
from spikewatch.trainer.config.sections import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    DistributedConfig,
    EvalConfig,
    FaultConfig,
    GuardConfig,
    LoopConfig,
    MixtureStage,
    ModelConfig,
    OptimConfig,
    ProbesConfig,
    ScheduleConfig,
    TrainConfig,
)
from spikewatch.trainer.config.settings import WatchSettings

__all__ = [
    "CONFIG_DIR",
    "VARIANT_DIR",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "EvalConfig",
    "FaultConfig",
    "GuardConfig",
    "LoopConfig",
    "MixtureStage",
    "ModelConfig",
    "OptimConfig",
    "ProbesConfig",
    "ScheduleConfig",
    "TrainConfig",
    "WatchSettings",
    "apply_overrides",
    "apply_variants",
    "find_config",
    "load_config",
    "validate_config",
    "variant_names",
]
