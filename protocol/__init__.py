"""Wire protocol: typed messages, the msgpack codec with raw tensor frames, ZeroMQ channels.

Importing this package does not import torch: the codec imports it lazily, on the first
message that carries a tensor, so the scheduler and the client import fast.
"""
