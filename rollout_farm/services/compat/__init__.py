"""Other APIs served on the farm's domain objects, for clients written against them.

openai_api.py     OpenAICompat: /v1/completions and /v1/chat/completions (rollout_farm/services/api/openai.py) become
rollouts
                  through the Fanout; logprobs from a scoring pass on a replica
openai_stream.py  the server-sent events of a streamed OpenAI answer
chat_render.py    ChatRenderer: chat templates rendered in the ingress, with the tokenizer a replica hands it once
sglang_native.py  SGLangNative: SGLang's own HTTP routes (/generate, the weight, pause and abort routes;
                  rollout_farm/services/api/sglang_native.py) translated onto Rollouts, WeightPush and the replicas'
                  control. This is the HTTP surface only; the SGLang engine is
                  rollout_farm/services/engine/sglang_engine.py.
"""
