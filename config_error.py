"""The error every config reader raises (``dsv4ray.config.ConfigError`` re-exports it), and the
small checks the readers and validators share."""


class ConfigError(ValueError):
    """A model config field is missing or invalid; the message names the field."""


def is_int(value: object) -> bool:
    """An int that is not a bool (JSON true must not pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)
