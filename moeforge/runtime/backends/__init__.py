"""Execution backends implementing the runtime Backend protocol."""
