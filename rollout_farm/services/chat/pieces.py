"""The text of each token of a sample, for logprobs answers (OpenAI's `tokens` and `top_logprobs`): a sample's
pieces in the ingress (rollout_farm/services/chat/renderer.py), a scored prompt's and its alternatives on the replica
that scores it (EngineServer.score)."""

from __future__ import annotations


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """The text each token adds, so that the pieces of a sample join to its text. Decoded in a short window of
    context (as vLLM does): a token that ends inside a multi-byte character adds "" and the token that completes
    it adds the character; a lone token would lose a SentencePiece leading space."""
    pieces, prefix, read = [], 0, 0
    for i in range(len(ids)):
        before = tokenizer.decode(ids[prefix:read], skip_special_tokens=True)
        text = tokenizer.decode(ids[prefix : i + 1], skip_special_tokens=True)
        if len(text) > len(before) and (not text.endswith("\ufffd") or i + 1 == len(ids)):
            pieces.append(text[len(before) :])
            prefix, read = read, i + 1
        else:
            pieces.append("")
    return pieces


def alternative(tokenizer, token_id: int) -> str:
    """An alternative token's text; a token that is part of a multi-byte character (no text of its own) goes by its
    vocabulary entry instead, so that no two alternatives share a key."""
    text = tokenizer.decode([token_id])
    return tokenizer.convert_ids_to_tokens(token_id) if "\ufffd" in text or not text else text
