"""The compute half of ppring: layer partition, model config, the Llama stage, weight loading of
a stage's own layers, the paged KV cache, attention and the sampler.

`stages.batch` (the scheduler's contract) and `stages.partition` / `stages.config` import no
torch; the rest does. Nothing here knows about sockets or requests' lifecycle.
"""
