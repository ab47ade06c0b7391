"""arealite configuration: typed sections, YAML + dotted overrides, validation, CLI.

    from arealite.config import load_config, parse_args
    cfg = load_config("examples/configs/default.yaml", ["actor.optimizer.lr=1e-5"])

`python -m arealite.config {show,schema,docs}` inspects configs from a shell. The names a
config gives to pieces of the packages above it (advantage estimator, policy loss, reward
function, workflow) are checked by those packages: `arealite.check` loads a run's config
with every check, and `python -m arealite.check` validates one from a shell.
"""

from arealite.config.cross_field_checks import check_config, config_problems
from arealite.config.launch_checks import SERVER_ADDRS_ENV, check_launch
from arealite.config.loader import dump_config, load_config, parse_args, parse_override_value
from arealite.config.problems import ConfigCheck, ConfigError, ConfigProblem
from arealite.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    ArealiteConfig,
    CriticConfig,
    DataConfig,
    EvaluationConfig,
    ExperimentConfig,
    GenerationConfig,
    LaunchConfig,
    OptimizerConfig,
    RecoverConfig,
    RolloutConfig,
    SaverConfig,
    ServerConfig,
    SGLangOptions,
    StatsConfig,
    TrainEngineConfig,
    WandbConfig,
    WeightSyncConfig,
)

__all__ = [
    "SERVER_ADDRS_ENV",
    "ActorConfig",
    "AlgorithmConfig",
    "ArealiteConfig",
    "ConfigCheck",
    "ConfigError",
    "ConfigProblem",
    "CriticConfig",
    "DataConfig",
    "EvaluationConfig",
    "ExperimentConfig",
    "GenerationConfig",
    "LaunchConfig",
    "OptimizerConfig",
    "RecoverConfig",
    "RolloutConfig",
    "SGLangOptions",
    "SaverConfig",
    "ServerConfig",
    "StatsConfig",
    "TrainEngineConfig",
    "WandbConfig",
    "WeightSyncConfig",
    "check_config",
    "check_launch",
    "config_problems",
    "dump_config",
    "load_config",
    "parse_args",
    "parse_override_value",
]
