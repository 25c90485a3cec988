"""The serving stack: tokenizer manager, scheduler, model runner, detokenizer."""
