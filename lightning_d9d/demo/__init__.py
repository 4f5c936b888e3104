"""The demo: a tiny GPT, the demo pretraining DataModule and synthetic data (the embedded corpus: ``demo_data``)."""
