"""The device side of a forward call: the runner, its forward batch, the attention
backends and the physical KV format, token slot storage and the sampler."""
