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


def logprobs(pieces: list[str], lps: list[float], text: str, chat: bool) -> dict:
    """The sampled tokens' logprobs in OpenAI's shape, for the tokens inside `text` (which a stop string may have cut).
    Only the sampled token's logprob is known: top_logprobs stay empty."""
    offsets = [sum(map(len, pieces[:i])) for i in range(len(pieces))]
    cut = sum(map(len, pieces)) > len(text)
    keep = [i for i, o in enumerate(offsets) if o < len(text) or not cut]
    if chat:
        return {"content": [{"token": pieces[i], "logprob": lps[i], "bytes": list(pieces[i].encode()), "top_logprobs": []} for i in keep]}
    return {"tokens": [pieces[i] for i in keep], "token_logprobs": [lps[i] for i in keep], "top_logprobs": None, "text_offset": [offsets[i] for i in keep]}


def choices(groups: list[P.Group], stop: str | list[str] | None, chat: bool, pieces: list[list[str]] | None) -> tuple[list[dict], dict]:
    """OpenAI choices (prompt-major, n per prompt) and the usage block; `pieces` (the text of each token) adds logprobs."""
    out, prompt_tokens, completion_tokens = [], 0, 0
    for g in groups:
        prompt_tokens += len(g.prompt_token_ids)
        for s in g.samples:
            text, stopped = cut_at_stop(s.text, stop)
            reason = "stop" if stopped or s.finish_reason == "stop" else "length"
            lp = logprobs(pieces[len(out)], s.logprobs, text, chat) if pieces is not None else None
            body = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            out.append({"index": len(out), **body, "logprobs": lp, "finish_reason": reason})
            completion_tokens += len(s.token_ids)
    return out, {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def response(kind: str, model: str, groups: list[P.Group], stop, chat: bool, pieces: list[list[str]] | None = None) -> dict:
    picked, usage = choices(groups, stop, chat, pieces)
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": model, "choices": picked, "usage": usage}
