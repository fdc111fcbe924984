"""Multi-turn sessions and episodes: exact tokens across turns, tool calls, forks.

Sessions for agents that run outside the farm (token level, or OpenAI chat with tools), episodes run in the farm
against environment plug-ins, and episode groups in the shape a trainer learns from. The guide: docs/episodes.md.

A turn of `POST /v1/sessions/{id}/generate` or `.../chat/completions` (rollout_farm/services/api/sessions.py) through
this package:

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
                     (rollout_farm/services/replica/engine_server.py chat_turn), which holds the tokenizer
  tool_formats.py    TOOL_FORMATS: how a model writes a tool call (hermes, plain) and how it reads back as OpenAI
                     `tool_calls`, malformed calls counted with their reason
  tool_schemas.py    OpenAI tool definitions checked (names, parameters a valid JSON Schema), as 422 detail

An episode of `POST /v1/episodes` (rollout_farm/services/api/episodes.py), or of a queue's episode source:

  episodes.py        Episodes: a group of n episodes per prompt, concurrently; EpisodeRun: open a session, reset the
                     environment, then chat turn (Sessions.chat), step, observation, until done or a limit
  environments.py    the Environment interface (reset, step, close; its Params, tools, tool format), ENVIRONMENTS
  calculator.py      the built-in calculator environment
  openenv_remote.py  the built-in openenv environment: a remote openenv-core server, one WebSocket session (/ws)
                     per episode; a turn's text or tool call as the action, the server's reward and done
  episode_groups.py  an episode group as a rollout group: the shared opening as the prompt, loss_mask 0 on
                     observations (the queue and the trainer take it)
"""
