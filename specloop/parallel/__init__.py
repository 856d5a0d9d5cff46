"""Tensor parallelism below the engine: the model's weights split by head and MLP column
(`shard`) and the process group whose all-reduce joins the ranks' partial sums (`group`)."""
