"""``moeforge.MoERouter``: DeepSeek expert routing as one custom op (contract in README.md)."""
