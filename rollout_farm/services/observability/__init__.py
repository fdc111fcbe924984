"""What the service says about itself: structured logs and Prometheus metrics.

| module | owns |
| --- | --- |
| `metrics.py` | every Prometheus metric, and the scrape (replica gauges read at scrape time, from a table) |
| `logs.py` | JSON log lines: one object per line, the event and its fields |
"""
