"""The inference engines that sample rollouts: `hf` (the trainer's own model), `vllm` (in process) and
`vllm-server` (`vllm serve` processes), one token-in/token-out interface (`generation`), and the weights
they are synced with (`weight_buckets`, `served_checkpoint`).

"Engine" in this package always means an inference engine; the replay engine that trains on trees is
`treetrain.replay`.
"""
