"""The trainer of the tiny family's checkpoints (``checkpoints/stdlib-tiny``): the training loop
over the reference's layer code, and its corpus, this Python's standard library sources."""
