"""Multi-turn sessions and episodes: exact tokens across turns, tool calls, forks.

Built so far: token-level sessions over HTTP, and the pieces the chat route with tools will use. Not yet: the OpenAI
chat route on a session, environments run in the farm, sticky replicas and the KV cache kept between turns, the
trainer's side.

A turn of `POST /v1/sessions/{id}/generate` (services/api/sessions.py) through this package:

  sessions.py        Sessions.generate: under the session's lock, a retry (same turn, same ids) gets its stored
                     answer; an offset forks the head segment; else the client's ids and then the sampled ids are
                     appended to the head, sampled through the rollout path (services/rollout/rollouts.py)
  session_store.py   the session as one JSON value in Redis, expiring ttl_s after its last change; its turn lock
  segments.py        a session's tokens in segments that only grow: sampled ids verbatim (loss mask 1), context
                     (mask 0), per-token logprobs and weight versions, turns; forks name their parent
  chat_delta.py      for the chat route: only the messages a turn adds, rendered through the chat template (the
                     history is never rendered again), the turn's closing tokens, and the generation prompt
  tool_formats.py    TOOL_FORMATS: how a model writes a tool call (hermes, plain) and how it reads back as OpenAI
                     `tool_calls`, malformed calls counted with their reason
  tool_schemas.py    OpenAI tool definitions checked (names, parameters a valid JSON Schema), as 422 detail
"""
