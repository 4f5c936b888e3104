"""The demo: a corpus and tokenizer built from text that ships with Python, a tiny GPT, and synthetic data."""
