"""Translate OpenAI completion requests to rollouts, and rollouts back to OpenAI's response shape."""

import time
import uuid

from services import protocol as P


def sampling(max_tokens: int, temperature: float, top_p: float, seed: int | None) -> P.SamplingParams:
    return P.SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)


def cut_at_stop(text: str, stop: str | list[str] | None) -> tuple[str, bool]:
    """text up to the first stop string (excluded), and whether one was found."""
    stops = [stop] if isinstance(stop, str) else (stop or [])
    cuts = [text.find(s) for s in stops if s and s in text]
    return (text[:min(cuts)], True) if cuts else (text, False)


def choices(groups: list[P.Group], stop: str | list[str] | None, chat: bool) -> tuple[list[dict], dict]:
    """OpenAI choices (prompt-major, n per prompt) and the usage block."""
    out, prompt_tokens, completion_tokens = [], 0, 0
    for g in groups:
        prompt_tokens += len(g.prompt_token_ids)
        for s in g.samples:
            text, stopped = cut_at_stop(s.text, stop)
            reason = "stop" if stopped or s.finish_reason == "stop" else "length"
            body = {"message": {"role": "assistant", "content": text}} if chat else {"text": text, "logprobs": None}
            out.append({"index": len(out), **body, "finish_reason": reason})
            completion_tokens += len(s.token_ids)
    return out, {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def response(kind: str, model: str, groups: list[P.Group], stop, chat: bool) -> dict:
    picked, usage = choices(groups, stop, chat)
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": model, "choices": picked, "usage": usage}
