"""Tenants: training runs sharing one farm, each with its own hashed tokens; who may use and change what.

| module | owns |
| --- | --- |
| `admission.py` | `Admission`: per-tenant quotas (in-flight samples, tokens/s) and weighted-fair shares, in Redis |
| `registry.py` | `Tenants` (tokens kept as SHA-256 in Redis: create, list, revoke); `Principal`, who calls |
"""
