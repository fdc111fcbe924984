"""The extension points: what a user registers by name or names by dotted path, and the built-ins of each.

| module | owns |
| --- | --- |
| `registry.py` | `Registry`, the one type behind every extension point (names, dotted paths, helpful misses) |
| `plugins.py` | the `FARM_PLUGINS` modules: imported at start-up, the only ones a request or setting may name |
| `samplers.py` | the sampler plug-in API (`Sampler`, its hooks and `Params`) and the built-in samplers |
| `rewards.py` | reward functions, registered by name (`gsm8k`, `last_number`, `zero`) |
| `tasks.py` | prompt sources with reference answers: arithmetic, addition, products, GSM8K |
"""
