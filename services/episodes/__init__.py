"""Multi-turn sessions and episodes: exact tokens across turns, tool calls, forks.

Built so far (the session's token model; the HTTP routes, episode environments and the trainer's side come next):

  chat_delta.py    only the messages a turn adds, rendered through the chat template (the history is never
                   rendered again), the turn's closing tokens, and the generation prompt
  segments.py      a session's tokens in segments that only grow: sampled ids appended verbatim (loss mask 1),
                   rendered context (mask 0), per-token logprobs and weight versions, turns; a rewritten history
                   forks a segment that names its parent; a retried turn is found again
  tool_schemas.py  OpenAI tool definitions checked (names, parameters a valid JSON Schema), as 422 detail
  tool_formats.py  TOOL_FORMATS: how a model writes a tool call (hermes, plain) and how it reads back as OpenAI
                   `tool_calls`, malformed calls counted with their reason

A turn, as a session will run it: the request's messages extend the head segment (or fork it), chat_delta renders
the new ones, the engine samples from the segment's tokens, the sampled ids are appended as they are, and the
tool format reads the calls out of the sampled text.
"""
