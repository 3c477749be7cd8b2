"""The compute half: a Llama shard that owns layers [start, end), its KV storage, the sampler."""
