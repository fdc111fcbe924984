"""Multi-turn sessions and episodes: exact tokens across turns, tool calls, forks.

Built so far: sessions over HTTP, token level and OpenAI chat with tools. Not yet: environments run in the farm,
sticky replicas and the KV cache kept between turns, the trainer's side.

A turn of `POST /v1/sessions/{id}/generate` or `.../chat/completions` (services/api/sessions.py) through this package:

  sessions.py        Sessions.generate and .chat: under the session's lock, a retry (same turn and ids, or a history
                     already answered) gets its stored answer; an offset or a rewritten history forks the head
                     segment; else the new context and then the sampled ids are appended to the head, sampled
                     through the rollout path the ingress hands it (Rollouts.answer)
  chat_turns.py      a chat turn's OpenAI side: tools and tool_choice checked, sampling params, the sampled text read
                     by the tool format, the answer as a chat completion with tool_calls
  session_store.py   the session as one JSON value in Redis, expiring ttl_s after its last change; its turn lock
  segments.py        a session's tokens in segments that only grow: sampled ids verbatim (loss mask 1), context
                     (mask 0), per-token logprobs and weight versions, turns; forks name their parent
  chat_delta.py      only the messages a chat turn adds, rendered through the chat template (the history is never
                     rendered again), the turn's closing tokens, and the generation prompt; run on an engine replica
                     (services/replica/engine_server.py chat_turn), which holds the tokenizer
  tool_formats.py    TOOL_FORMATS: how a model writes a tool call (hermes, plain) and how it reads back as OpenAI
                     `tool_calls`, malformed calls counted with their reason
  tool_schemas.py    OpenAI tool definitions checked (names, parameters a valid JSON Schema), as 422 detail
"""
