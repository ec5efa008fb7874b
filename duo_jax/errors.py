"""User-facing errors.

Every problem a user can fix (missing weights, a bad argument, a pattern that does not fit the model)
raises a subclass of `DuoJaxError` whose message names the problem and the fix. The CLIs catch exactly
this class, print its message on one line and exit with status 2.
"""

import argparse
import os
from pathlib import Path


class DuoJaxError(Exception):
    """A problem the user can fix; the message says how."""


class ConfigError(DuoJaxError, ValueError):
    """A model config that duo-jax cannot build or does not support."""


class LoadError(DuoJaxError):
    """Weights or tokenizer that cannot be found or do not match the config."""


class WeightsNotFoundError(LoadError, FileNotFoundError):
    """No weights at any place that was searched."""


class BackendError(DuoJaxError):
    """An implementation asked for that this JAX or device cannot run."""


class DeviceMemoryError(DuoJaxError, MemoryError):
    """What a request, a server or a train step would hold does not fit the device's memory
    (`duo_jax.device_memory`): the message names the sizes and the options that shrink them."""


class InvalidOption(DuoJaxError, ValueError):
    """A bad value for a named option or request field (`param`: its name), e.g. a temperature of NaN."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def read_user_text(path, error: type[DuoJaxError] = DuoJaxError, hint: str = "") -> str:
    """A file the user named, as UTF-8 text; one that is not raises `error` naming it, its first bad byte and `hint`
    (a missing file stays an OSError, which the CLIs report as it is)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}){hint}") from None


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The command lines' help: descriptions as written, and each option's default after its help, except where
    there is none to show (None, an off switch, a required option) or the help already says it ("(default" or
    "default:"; a help that only mentions the value 'default' still gets it)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or action.required:
            return text
        if "(default" in text or "default:" in text:
            return text
        return super()._get_help_string(action)


def integer_argument(what: str, minimum: int, maximum: int | None = None):
    """An argparse type: an integer in [minimum, maximum] (no maximum: at least `minimum`), checked as the command
    line is parsed (before any model loads); anything else is argparse's error: must be `what`, got the text."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    return parse


def check_output_folder(path, option: str = "--out") -> Path:
    """`path` as a folder a command can write its results into, checked before any work: it, or the nearest of
    its parents that exists, must be a writable folder; else an error naming `option` (found after a long run,
    the same problem costs the run)."""
    path = Path(path)
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise DuoJaxError(f"{option} {path}: {existing} is a file, not a folder; pass a folder path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise DuoJaxError(f"{option} {path}: {existing} is not writable; pass a folder you can write to")
    return path
