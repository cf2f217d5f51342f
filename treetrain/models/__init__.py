"""Models: the decoder forward against explicit KV, chunked logprobs, presets and support checks."""

#: Attention implementations the engine is tested with.
ATTENTION: tuple[str, ...] = ("eager", "sdpa")

DEFAULT_MAX_LOGIT_ELEMENTS = 1 << 24
"""Largest logits chunk (rows x vocabulary) materialized at once: 64 MiB of float32. Here rather than in
`treetrain.models.logprobs` so that the config can name it without importing torch."""
