"""Typed run configuration: YAML files, ``KEY=VALUE`` overrides, checks with clear messages."""
from .load import (apply_overrides, config_from_dict, config_to_dict, describe_schema, dump_config, load_config,
                   parse_override, save_config)
from .schema import (DEFAULT_CORPUS, CkptConfig, Config, ConfigError, DataConfig, EvalConfig, ModelConfig, MoEConfig,
                     ParallelConfig, RunConfig, TrainConfig)

__all__ = [
    "Config", "ConfigError", "RunConfig", "ModelConfig", "MoEConfig", "ParallelConfig", "DataConfig", "TrainConfig",
    "EvalConfig", "CkptConfig", "DEFAULT_CORPUS", "load_config", "config_from_dict", "config_to_dict", "dump_config",
    "save_config", "apply_overrides", "parse_override", "describe_schema",
]
