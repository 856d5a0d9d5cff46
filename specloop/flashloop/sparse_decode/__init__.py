"""Sparse decode attention with a per-token loop-2 reference (`sparse_decode_attention`) as a
plug-in feature."""
