"""Models: the decoder forward against explicit KV, chunked logprobs, presets and support checks."""

#: Attention implementations the engine is tested with.
ATTENTION: tuple[str, ...] = ("eager", "sdpa")
