"""User-facing errors: the CLI prints the message (no traceback; the chained cause with --debug) and exits
with code 2. Every one is an `eagle3_runtime.errors.Eagle3Error`, the runtime's refusals too."""
from eagle3_runtime.errors import Eagle3Error


class UserError(Eagle3Error):
    """Bad input: a recipe, checkpoint or pair the build must refuse, with the fix in the message."""


class CheckpointError(UserError):
    pass


class PairError(UserError):
    pass


class VerifyError(UserError):
    """Bad input to verify (bundle, prompts, target source)."""
