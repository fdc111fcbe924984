"""vLLM alone, through its offline Python API: bench/engines.py's baseline arm, run with vLLM's own interpreter.

    .venv-vllm/bin/python bench/engines_vllm_alone.py --model FOLDER [--max-model-len N]

vLLM cannot be imported next to the farm (its transformers pin conflicts with verl's), so bench/engines.py starts
this script once per model and keeps it alive across rounds: it builds one `vllm.LLM` (float32, eager: the farm's
settings), then serves rounds over stdin/stdout, one JSON line each way:

    in:  {"prompts": [[token ids], ...], "n": 8, "max_tokens": 64, "seed": 3 or null}
    out: {"seconds": 1.23, "tokens": 4096, "logprobs": 4096}

Each round is one `LLM.generate` call with TokensPrompt inputs and SamplingParams(n, temperature 1, seed (if any),
ignore_eos, logprobs=0: the sampled token's own logprob, as the farm returns it; detokenize off, as the farm asks of
its server, so both sides do the same work inside vLLM). vLLM logs to stdout, so the answers go to a copy of the
original stdout and everything else to stderr. The KV cache size and thread binding come from the environment
(VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND, OMP_NUM_THREADS), set by bench/engines.py as the farm sets them.
EOF on stdin ends it.
"""

import argparse
import json
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-model-len", type=int, default=None)
    args = ap.parse_args()

    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's log lines (and anything else on stdout) go to stderr
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t = time.perf_counter()
    # the farm's scheduler (rollout_farm/services/engine/vllm_engine.py): no prompt split over steps
    from transformers import AutoConfig

    context = args.max_model_len or AutoConfig.from_pretrained(args.model).max_position_embeddings
    llm = LLM(
        model=args.model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=context,
        enable_chunked_prefill=False,
        max_num_batched_tokens=max(context, 2048),
    )
    answers.write(json.dumps({"ready": True, "start_s": time.perf_counter() - t}) + "\n")
    for line in sys.stdin:
        ask = json.loads(line)
        params = SamplingParams(
            n=ask["n"],
            temperature=1.0,
            seed=ask["seed"],
            max_tokens=ask["max_tokens"],
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
        )
        prompts = [TokensPrompt(prompt_token_ids=p) for p in ask["prompts"]]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        samples = [c for o in outs for c in o.outputs]
        tokens = sum(len(c.token_ids) for c in samples)
        logprobs = sum(len(c.logprobs or []) for c in samples)
        answers.write(json.dumps({"seconds": seconds, "tokens": tokens, "logprobs": logprobs}) + "\n")


if __name__ == "__main__":
    main()
