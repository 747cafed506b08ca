"""Device-side execution of a stage: captured decode and verification steps (CUDA graphs),
overlap scheduling's device-filled lookahead tokens, and the rows and sampled ids that stages on
one GPU share through CUDA IPC."""
