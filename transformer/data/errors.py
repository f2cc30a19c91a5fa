"""The one exception the input pipeline raises for bad data or settings."""


class DataError(ValueError):
  """Input that cannot be used; the message names the file (and line) or key, and the fix."""
