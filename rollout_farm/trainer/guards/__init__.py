"""The KL and variance guards: `checks.py` says what to do when a threshold is crossed, the trainer does it.

| module | owns |
| --- | --- |
| `checks.py` | the KL and variance guards (`guards.*` config): what to do when a threshold is crossed |
| `actions.py` | what the trainer does then: roll back to the last good step (or checkpoint), resize the mini-batch |
| `last_good.py` | the last step the guards kept, in CPU memory: what a rollback restores |
"""
