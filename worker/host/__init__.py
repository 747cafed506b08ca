"""A stage's KV beyond its device pools: copies to and from the host tier (HiCache) and a C4
layer's cache under HiSparse (host history, device hot rows)."""
