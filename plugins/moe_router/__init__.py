"""MoE router custom op (moeforge.MoERouter)."""
