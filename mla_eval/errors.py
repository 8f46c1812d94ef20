"""Errors a user can fix. The CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """Bad input: the message names the problem and the fix, and fits on one line."""


class NonFiniteInputError(UserError, ValueError):
    """A latent or rope value handed to a cache writer is NaN or infinite."""


class UnknownFormatError(UserError, KeyError):
    """A format name that is not registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""
