"""Paged attention custom op (moeforge.PagedAttention)."""
