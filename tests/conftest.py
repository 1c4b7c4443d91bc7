"""Test-wide settings: no network, deterministic threads."""

import os

# Nothing in the suite may reach a model hub; transformers must read only local files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
