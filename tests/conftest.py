"""Test-session set-up: no test may reach a model or data hub, so the Hugging Face libraries run offline.

Set here, before any test module imports ``datasets`` (``huggingface_hub`` reads these once, at import).
"""

import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
