"""What runs inside vLLM's own environment (.venv-vllm), not the farm's: the vLLM engine (vllm_engine.py) puts this
folder on the server's PYTHONPATH, so its modules import as top-level modules there and must import nothing from
rollout_farm (whose dependencies that environment does not have).

| module | owns |
| --- | --- |
| `farm_vllm_launch.py` | starts vLLM's server; ends its process group once the replica that started it is gone |
| `farm_vllm_worker.py` | the worker extension (`--worker-extension-cls`): a load by folder that is right on CPU |
"""
