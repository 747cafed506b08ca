"""cluster."""
