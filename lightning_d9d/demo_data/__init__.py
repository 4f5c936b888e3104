"""The demo's embedded data: a corpus, conversations and parquet shards built from text that ships with Python.

No Lightning here: ``TextDataModule(dataset="demo")`` and the demo's DataModules build it, so it sits below them.
"""
