"""moeforge: compile DeepSeek-style LLMs into deployable inference artifacts and run them."""

__version__ = "0.1.0"
