"""Custom ops (MoE routing, paged attention): one folder per op."""
