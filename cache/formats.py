"""The facts every layer shares about KV pages (pure Python; cache/layout.py has the bytes).

One full page holds PAGE_SIZE logical tokens; a compressed pool of ratio r holds the entries of
the same tokens in the page with the same id (PAGE_SIZE // r entries), so one id moves every pool
of a page. Window pages hold WINDOW_PAGE_SIZE tokens (the sliding window).
"""

PAGE_SIZE = 256
WINDOW_PAGE_SIZE = 128
KINDS = ("window", "c4", "c128", "indexer")  # pool kinds, in the order buffers are listed
DTYPES = ("fp8", "bf16", "fp32")  # kv_cache_dtype: every pool kind in one format
ENTRIES_PER_PAGE = {"window": 128, "c4": 64, "c128": 2, "indexer": 64}
