"""model/layers."""
