"""Text in and out of the model, in pure Python: the tokenizer and streaming detokenizer, chat
encoding (DeepSeek-V4's chat format and jinja templates), DSML tool calls, and the byte
tokenizer files of the tiny checkpoints."""
