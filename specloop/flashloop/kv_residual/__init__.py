"""INT4 cross-loop KV residuals (`kv_residual_quantization`) as a plug-in feature."""
