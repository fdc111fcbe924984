"""Chat: messages through the model's chat template, a session turn's tokens, tool calls, token texts.

Everything that turns chat messages into tokens, or sampled tokens back into chat, lives here, whichever front door
asks (the OpenAI routes, sessions, episodes). The functions take a tokenizer; in the ingress it is the engine
replicas' own, fetched once (`renderer.py`), so nothing here runs on a replica or calls one. A replica uses
`template.prompt_ids` and `pieces.py` itself, for rollouts and scoring. The package imports only base modules
(`protocol/`, `extensions/registry.py`): `replica/`, `compat/` and `episodes/` import it.

| module | owns |
| --- | --- |
| `template.py` | `render`: messages and tools through the chat template; `for_template`; `prompt_ids` of a prompt |
| `delta.py` | a session turn's tokens (`turn`): new messages, close, generation prompt; `NotAppendOnly` if none exact |
| `pieces.py` | each token's text, joining to the sample's text, and an alternative's text: for logprobs answers |
| `tool_formats/` | `TOOL_FORMATS`, a file per family's call format, read back by token id; `detect.py`: a model's own |
| `tool_schemas.py` | OpenAI tool definitions checked (names, `parameters` a JSON Schema of an object), as 422 detail |
| `renderer.py` | `ChatRenderer`: the ingress's tokenizer, asked of one replica once, and the functions above with it |
"""
