"""What a training run writes: checkpoints, each step's metrics (metrics.jsonl, log events, Prometheus), the console.

| module | owns |
| --- | --- |
| `checkpoint.py` | checkpoints written atomically; the latest one found and loaded for a resume |
| `step_metrics.py` | a step's metrics: one line of `metrics.jsonl`, a log event, Prometheus gauges |
| `staleness_metrics.py` | how far behind a step's samples are, what the rollout correction did to the late ones |
| `console.py` | `farm train --log-file` (the demo's): JSON log lines to the file; a progress bar and short lines |
"""
