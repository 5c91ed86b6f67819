//! Tokenizer, chat template and streaming detokenization.
