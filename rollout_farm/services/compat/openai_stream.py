"""OpenAI's streaming answer: server-sent events in its chunk format, ending with `data: [DONE]`.

Each choice is sent whole, once its samples finish (the engines return whole samples): a chunk with the text (and
logprobs; a session's turn also its tool_calls and the farm's token ids; with return_token_ids the sampled ids, and
the prompt's on the first chunk), then a chunk with its finish_reason.
With stream_options.include_usage, every chunk carries `"usage": null` and one last chunk has no choices and the
usage block.
"""

from __future__ import annotations

import json
from typing import AsyncIterator


def chunks(answer: dict, include_usage: bool) -> list[dict]:
    """The chunks of a finished answer (what completions() or chat() returned)."""
    chat = answer["object"] == "chat.completion"
    head = {
        "id": answer["id"],
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": answer["created"],
        "model": answer["model"],
    }
    extra = {"usage": None} if include_usage else {}
    out = []
    for c in answer["choices"]:
        if chat:
            delta = {"role": "assistant", "content": c["message"]["content"]}
            if c["message"].get("tool_calls"):  # a session's turn: each call whole, numbered as streams number them
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(c["message"]["tool_calls"])]
            body = {"index": c["index"], "delta": delta, "logprobs": c["logprobs"], "finish_reason": None}
            end = {"index": c["index"], "delta": {}, "logprobs": None, "finish_reason": c["finish_reason"]}
        else:
            body = {"index": c["index"], "text": c["text"], "logprobs": c["logprobs"], "finish_reason": None}
            end = {"index": c["index"], "text": "", "logprobs": None, "finish_reason": c["finish_reason"]}
        if "token_ids" in c:  # return_token_ids (vLLM's extension): the sampled ids on the content chunk
            body["token_ids"] = c["token_ids"]
        farm = {"farm": answer["farm"]} if "farm" in answer else {}  # a session's token ids, on the content chunk
        if not out and "prompt_token_ids" in answer:  # and the prompt's on the first chunk
            farm["prompt_token_ids"] = answer["prompt_token_ids"]
        out += [{**head, "choices": [body], **extra, **farm}, {**head, "choices": [end], **extra}]
    if include_usage:
        out.append({**head, "choices": [], "usage": answer["usage"]})
    return out


async def events(answer: dict, include_usage: bool) -> AsyncIterator[str]:
    for chunk in chunks(answer, include_usage):
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"
