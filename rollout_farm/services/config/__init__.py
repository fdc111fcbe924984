"""The service's settings: every `FARM_*` variable, checked at start-up, and the page that documents them.

| module | owns |
| --- | --- |
| `settings.py` | every `FARM_*` setting, and the one-line-per-variable explanation of a bad one |
| `settings_doc.py` | docs/settings.md, generated from the settings model |
"""
