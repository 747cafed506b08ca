"""One stage's execution: StageWorker, batch tensors, the paged network, sampling, host-tier
copies, and the in-process pipeline."""
