"""Other APIs served on the farm's domain objects, for clients written against them.

The routes are in rollout_farm/services/api/ (openai.py, sglang_native.py); their requests become rollouts through
the Fanout. A chat request's messages are rendered in the ingress (rollout_farm/services/chat/renderer.py); the
SGLang engine is rollout_farm/services/engine/sglang_engine.py, not this HTTP surface.

| module | owns |
| --- | --- |
| `openai_api.py` | `OpenAICompat`: /v1/completions and /v1/chat/completions as rollouts; logprobs from a scoring pass |
| `openai_stream.py` | the server-sent events of a streamed OpenAI answer |
| `anthropic.py` | a session's Anthropic Messages turn: blocks to chat messages and tools, the completion as a Message |
| `anthropic_stream.py` | the server-sent events of a streamed Anthropic Message (Anthropic's event types) |
| `responses.py` | a session's OpenAI Responses turn: input items to chat messages, `previous_response_id` |
| `responses_stream.py` | the server-sent events of a streamed Response (`response.*` events with sequence numbers) |
| `sglang_native.py` | `SGLangNative`: SGLang's /generate, weight, pause and abort routes onto Rollouts and WeightPush |
| `sglang_shapes.py` | SGLang's /generate fields onto the farm's, and each sample back in SGLang's answer shape |
| `vllm_tokens.py` | `VLLMTokens`: vLLM's /inference/v1/generate (token ids in, ids and logprobs out) as rollouts |
| `tinker.py` | `TinkerCompat`: Tinker's sampling API for the tinker SDK: sessions, samples as rollouts, futures |
| `tinker_proto.py` | the protobuf `SampleResponse` a Tinker sample answers with, encoded by hand |
"""
