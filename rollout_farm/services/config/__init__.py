"""The service's settings: every `FARM_*` variable, checked at start-up, and the page that documents them.

| module | owns |
| --- | --- |
| `settings.py` | every `FARM_*` setting, and the one-line-per-variable explanation of a bad one |
| `remote_environments.py` | FARM_ENV_ALLOWED_HOSTS's host:port patterns and FARM_MCP_SERVERS's entries |
| `settings_doc.py` | docs/settings.md, generated from the settings model |
"""
