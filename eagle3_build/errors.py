"""User-facing errors: the CLI prints the message (no traceback) and exits with code 2."""


class UserError(Exception):
    """Bad input: a recipe, checkpoint or pair the build must refuse, with the fix in the message."""


class CheckpointError(UserError):
    pass


class PairError(UserError):
    pass
