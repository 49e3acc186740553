"""EQuARX serve."""
