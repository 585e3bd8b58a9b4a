"""User-facing errors and the process exit codes they map to.

Every refusal k3 makes is a K3Error: one paragraph that names the file, tensor or
field at fault and what to do about it. The CLI prints the message (never a
traceback) and exits with the error's code.
"""

# Exit codes (documented in README.md and `k3 --help`).
EXIT_OK = 0
EXIT_RUNTIME = 1  # refusal to start, bind/forward failure, memory plan refused
EXIT_USAGE = 2  # bad command line, config not readable with confidence, bad token ids
EXIT_CHECKPOINT = 3  # checkpoint files malformed, truncated or incomplete
EXIT_READ = 4  # a weight read failed or came back short during a run (output invalid)
EXIT_PIPELINE = 5  # a pipeline over several processes failed: a rank differs, died, hung or is unreachable


class K3Error(Exception):
    """An error meant for the user: message plus exit code, no traceback."""

    exit_code = EXIT_RUNTIME

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class ConfigError(K3Error):
    exit_code = EXIT_USAGE


class UsageError(K3Error):
    exit_code = EXIT_USAGE


class CheckpointError(K3Error):
    exit_code = EXIT_CHECKPOINT


class ReadError(K3Error):
    exit_code = EXIT_READ


class NumericError(K3Error):
    """The forward pass produced NaN or inf: the output would be garbage, so none is
    given. The message names where the numbers first stopped being finite."""

    exit_code = EXIT_RUNTIME


class PipelineError(K3Error):
    """A pipeline over several processes (k3.pipeline) cannot go on: a rank's checkpoint,
    config or k3 version differs, or a rank died, hung or cannot be reached."""

    exit_code = EXIT_PIPELINE
