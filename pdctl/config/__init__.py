"""pdctl.toml as a typed config, in three modules by job:

- `schema`: every table as a pydantic model, every key with its default, range and description,
  and what the schema alone implies (`match_sites`, the PPGD sources' layout);
- `load`: the TOML tables into a `Config` (`parse_config`: one line naming the key path for a
  mistake), the checks across tables, and what of a config a stage depends on (`fingerprint`,
  `config_snapshot`);
- `example`: `pdctl.toml.example` rendered from the schema (`python -m pdctl.config --example`).

The names the rest of pdctl uses are importable from here.
"""

from pdctl.config.example import EXAMPLE_COMMAND, example_toml, main
from pdctl.config.load import config_snapshot, fingerprint, parse_config
from pdctl.config.schema import (
    AUTO_SCAN_LAYERS,
    MAX_POOL_SIZE,
    SCHEMA_VERSION,
    CiFnConfig,
    Config,
    DecompConfig,
    LlamaTarget,
    LossConfig,
    MeshConfig,
    OptimConfig,
    PpgdConfig,
    PrecisionConfig,
    ResidMlpTarget,
    SiteConfig,
    TmsTarget,
    TrainConfig,
    assigned_per_micro_batch,
    is_sequence_model,
    match_sites,
    ppgd_source_layout,
)

__all__ = [
    "AUTO_SCAN_LAYERS",
    "EXAMPLE_COMMAND",
    "MAX_POOL_SIZE",
    "SCHEMA_VERSION",
    "CiFnConfig",
    "Config",
    "DecompConfig",
    "LlamaTarget",
    "LossConfig",
    "MeshConfig",
    "OptimConfig",
    "PpgdConfig",
    "PrecisionConfig",
    "ResidMlpTarget",
    "SiteConfig",
    "TmsTarget",
    "TrainConfig",
    "assigned_per_micro_batch",
    "config_snapshot",
    "example_toml",
    "fingerprint",
    "is_sequence_model",
    "main",
    "match_sites",
    "parse_config",
    "ppgd_source_layout",
]
