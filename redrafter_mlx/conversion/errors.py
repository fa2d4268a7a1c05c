"""The one error type of conversion: its message names the file and what is wrong with it."""


class ConversionError(ValueError):
    """A checkpoint cannot be converted; the message names the file and the problem."""
