"""Paged attention (domain ``moeforge``): see README.md for the I/O contract."""
