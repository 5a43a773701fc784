"""The run's configuration: `load.py` reads TOML/YAML and `--set` overrides into `Config`
and writes the resolved `config.toml`; `schema.py` declares every section and key with its
checks; `recipes.py` holds the configs written as Python (`TINY`, ...)."""
