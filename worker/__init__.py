"""One stage's execution. The core here: StageWorker, batch tensors, request tables, the paged
network and its ops, the last stage's draw, the in-process pipeline and the pool sizing every
pipeline shares. One subpackage per feature: sampling/, spec/ (speculative decoding), graphs/
(CUDA graphs, overlap scheduling, same-GPU links), host/ (host tier, HiSparse) and pd/
(prefill/decode handoffs)."""
