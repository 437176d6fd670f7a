"""Text: the model tokenizer (the `tokenizers` library only) and the incremental
detokenizer with stop strings."""
