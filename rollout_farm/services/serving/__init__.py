"""The service as a Ray Serve application: its deployments, and how `farm serve`, `serve run` and KubeRay start it.

| module | owns |
| --- | --- |
| `app.py` | the Serve application: the engine and ingress deployments (or the fused one), the `WeightStore` actor |
| `fused_front.py` | `FARM_FRONT=fused`: each engine replica is its own ingress; one replica's worth runs in process |
| `haproxy_orphans.py` | ends a haproxy that Serve's shutdown left running on the node this process started |
| `readiness.py` | when `farm serve` says "rollout service ready" (once /readyz does), and why not meanwhile |
| `server.py` | starts Ray, the embedded Redis (when `FARM_REDIS_URL` is unset) and the app; `farm serve` |
| `serve_entry.py` | the import path for `serve run rollout_farm.services.serving.serve_entry:app` and KubeRay |
"""
