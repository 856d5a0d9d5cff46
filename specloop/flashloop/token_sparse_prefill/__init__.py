"""Token-sparse prefill (`token_sparse_prefill`) as a plug-in feature."""
