"""The protobuf answer to a finished Tinker sample: `tinker_public.SampleResponse`, written by hand (no protoc, no
generated code). The SDK accepts a sample's result only in this form (JSON is refused).

The part of the schema written here (the SDK's proto/tinker_public_pb2.py holds all of it):

    message SampleResponse {
      repeated SampledSequence sequences = 1;
      optional bytes prompt_logprobs = 2;    // float32 little-endian, one per prompt token; NaN where not scored
    }
    message SampledSequence {
      StopReason stop_reason = 1;            // STOP = 0 (EOS or a stop sequence; the default, left out), LENGTH = 1
      bytes tokens = 2;                      // int32 little-endian
      optional bytes logprobs = 3;           // float32 little-endian, one per token
    }

The other fields (top-k logprobs, target and alternative prompt tokens, cache hits) are never requested: the farm
refuses those requests (rollout_farm/services/protocol/tinker.py).
"""

from __future__ import annotations

import math
import struct

STOP_REASONS = {"stop": 0, "length": 1}


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def sequence(tokens: list[int], logprobs: list[float] | None, stop_reason: str) -> bytes:
    """One SampledSequence; stop_reason "stop" or "length"."""
    reason = STOP_REASONS[stop_reason]
    out = varint(1 << 3 | 0) + varint(reason) if reason else b""
    out += field(2, struct.pack(f"<{len(tokens)}i", *tokens))
    if logprobs is not None:
        out += field(3, struct.pack(f"<{len(logprobs)}f", *logprobs))
    return out


def sample_response(
    sequences: list[tuple[list[int], list[float] | None, str]], prompt_logprobs: list[float | None] | None = None
) -> bytes:
    """A SampleResponse: each sequence (tokens, logprobs, stop_reason), and the prompt's logprobs (None: not
    scored, NaN on the wire; the SDK reads NaN back as None)."""
    out = b"".join(field(1, sequence(*s)) for s in sequences)
    if prompt_logprobs is not None:
        floats = [math.nan if x is None else x for x in prompt_logprobs]
        out += field(2, struct.pack(f"<{len(floats)}f", *floats))
    return out
