"""The error every config reader raises (``dsv4ray.config.ConfigError`` re-exports it)."""


class ConfigError(ValueError):
    """A model config field is missing or invalid; the message names the field."""
