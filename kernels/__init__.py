"""Triton kernels with torch references; `dsv4ray.kernels.dispatch` holds the public ops.

Modules: store_kv, compress (compress_norm_rope_store, reset_state), transfer
(transfer_cache_dsv4_mla, transfer_page_rows), indexer (indexer_topk), sparse_mqa, sampler
(gumbel_argmax: the sampling pass's Gumbel-max draw); entries and bits are the shared page-entry
and bit-exact encoding helpers; testing holds the comparison helpers.
"""
