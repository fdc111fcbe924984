"""Multi-turn sessions and episodes: exact tokens across turns, tool calls, forks.

Sessions for agents that run outside the farm (token level, or OpenAI chat with tools), episodes run in the farm
against environment plug-ins. The guide: docs/episodes.md.

A turn of `POST /v1/sessions/{id}/generate` or `.../chat/completions` (rollout_farm/services/api/sessions.py) goes
sessions -> chat_turns -> segments -> session_store -> token_columns, sampled through the rollout path the ingress
hands it (Rollouts.answer). A chat turn's tokens are rendered in the ingress, with the replicas' tokenizer
(rollout_farm/services/chat/: delta.py renders only the messages a turn adds; tool_formats.py reads the tool calls).
An episode of `POST /v1/episodes` (rollout_farm/services/api/episodes.py), or of a queue's episode source, goes
episodes -> environments -> sessions.

| module | owns |
| --- | --- |
| `sessions.py` | `Sessions`: a turn under the session's lock: a retry gets its stored answer, a rewrite forks |
| `chat_turns.py` | a chat turn's OpenAI side: tools and tool_choice checked, sampling params, the chat completion |
| `session_store.py` | the session in Redis, append-only (a turn writes what it adds), expiring ttl_s after; turn lock |
| `token_columns.py` | a segment's per-token columns packed as Redis holds them; `Tail`, the end of one a turn holds |
| `segments.py` | a session's tokens in segments that only grow: sampled ids (mask 1), context (mask 0), forks |
| `history_match.py` | a harness's history against the stored turns: the shared messages, the normalisations it took |
| `episodes.py` | `Episodes`: n episodes per prompt; `EpisodeRun`: reset, chat turn, step, until done or a limit |
| `environments.py` | the `Environment` interface (reset, step, close; Params, tools, tool format), `ENVIRONMENTS` |
| `calculator.py` | the built-in calculator environment |
| `openenv_remote.py` | the built-in openenv environment: a remote openenv-core server, one WebSocket per episode |
| `mcp_env.py` | the built-in mcp environment: an MCP server's tools (stdio from FARM_MCP_SERVERS, or HTTP) |
| `mcp_tools.py` | MCP tools as OpenAI function tools, and a tool result as the text the model reads (mcp and openenv) |
| `allowed_hosts.py` | FARM_ENV_ALLOWED_HOSTS: where remote environments may connect, checked after DNS, pinned |
"""
