"""Errors a user can act on. The CLI prints these as one line, without a traceback."""


class AttnlabError(Exception):
    """Base class of every error caused by user input (a file, a name, a value)."""


class ConfigError(AttnlabError, ValueError):
    """An unknown preset or key, or a value of the wrong type or out of range (a ValueError too)."""


class DataError(AttnlabError):
    """A missing, empty or malformed data file."""


class CheckpointError(AttnlabError):
    """A missing, truncated or corrupt checkpoint."""


class ConversionError(AttnlabError):
    """A model or checkpoint with no equivalent in the other format (Hugging Face export and import)."""


class GenerationError(AttnlabError):
    """A decoding the model cannot do: past its learned positions, or from non-finite logits."""
