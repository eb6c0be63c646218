"""The server configuration: typed sections (``sections``) composed into ``ServerConfig``, filled
from CLI > environment > YAML > defaults (``loading``). Every name is importable from here."""

from llmserve.config.loading import (ALIASES, ENV_PREFIX, FIELDS, FLAG_ALIASES, _kind, field_owner, flag_name,
                                     flat_values, load_config, load_options, option_env, option_flag, parse_text,
                                     read_yaml, unknown_key_message, validation_message)
from llmserve.config.sections import (SECTION_OF, SECTIONS, CacheConfig, GuidedConfig, LimitsConfig, ModelConfig,
                                      ParallelConfig, ParsingConfig, SchedulerConfig, Section, ServerConfig,
                                      ServerHTTPConfig, SpeculativeConfig)

__all__ = [
    "ALIASES", "ENV_PREFIX", "FIELDS", "FLAG_ALIASES", "SECTIONS", "SECTION_OF", "CacheConfig", "GuidedConfig",
    "LimitsConfig", "ModelConfig", "ParallelConfig", "ParsingConfig", "SchedulerConfig", "Section", "ServerConfig",
    "ServerHTTPConfig", "SpeculativeConfig", "_kind", "field_owner", "flag_name", "flat_values", "load_config",
    "load_options", "option_env", "option_flag", "parse_text", "read_yaml", "unknown_key_message",
    "validation_message",
]
