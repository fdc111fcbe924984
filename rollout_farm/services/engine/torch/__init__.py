"""The torch engine (FARM_ENGINE=torch): any HF causal LM on CPU or CUDA, as parts that TorchEngine builds and wires.

| module | owns |
| --- | --- |
| `engine.py` | TorchEngine, the Engine verbs: builds the parts, gives each what it uses, delegates to them |
| `model.py` | ServedModel: the HF model and tokenizer, the model lock, the served version, the staged weights |
| `scheduler.py` | Scheduler: the pending and running calls, their Batch and Slots, the loop thread, commits, aborts |
| `row_endings.py` | RowEndings, the Scheduler's part that ends rows and calls: outputs, the batch's removal, delivery |
| `call.py` | Call: one generate call's prompts, params, cancel event, future and outputs |
| `batch.py` | Batch: the running rows' left-padded KV cache (prefill, decode, verify); Slots: their outputs so far |
| `prefill.py` | Prefill: the session KV cache, the prompt cache, a prompt's prefill shared by its rows |
| `session_cache.py` | SessionKV: a session's KV cache between turns, bounded in bytes (least recently used evicted) |
| `sampling.py` | the per-row draw (temperature, top-k/p, seed, regex, stop strings); Draws: which rows draw together |
| `hold.py` | Hold: SGLang's pause modes that hold the running rows (in_place, retract); Continuation |
| `draft_step.py` | Drafter: a decode step that verifies drafts from the History (speculative decoding) |
| `lora.py` | LoraLayers: batched LoRA, each row its adapter (segmented gather), residency and pins per key |
| `speculative.py` | History: drafts from a prompt's earlier and running sequences; verify: the exact acceptance rule |
"""

from rollout_farm.services.engine.torch.engine import TorchEngine

__all__ = ["TorchEngine"]
