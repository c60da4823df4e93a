"""Errors the user can fix: a bad configuration value, missing or malformed input data, a
checkpoint or model directory that cannot be used, a wrong command-line argument.

The command line (``moe_dist.commands.common.user_errors``) prints a :class:`UserError` as one
line and exits with 2; every other exception is a bug or an environment failure and keeps its
traceback. Raise these only where the message tells the user what to change. This module
imports nothing, so every layer can use it.
"""
from __future__ import annotations


class UserError(ValueError):
    """Something the user can fix; the message names the key, file or argument and what is allowed."""


class ConfigError(UserError):
    """A configuration value is unknown, of the wrong type or out of range."""


class InputError(UserError):
    """Input data (corpus, tokenizer, token cache) that cannot be used as given."""


class MissingInputError(UserError, FileNotFoundError):
    """A file or directory the user named does not exist, or holds nothing usable."""


class CheckpointError(UserError):
    """A checkpoint cannot be used: incomplete, corrupted, or of another model."""


class DamagedCheckpoint(CheckpointError):
    """A complete checkpoint whose files no longer match its manifest (missing, truncated,
    corrupted, unreadable metadata): ``resume=auto`` sets it aside and takes the previous one."""


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint that asks its reader to run code or to read outside its directory (a pickled
    entry, a record that is not a plain tensor): refused unread, also by ``resume=auto`` (such a
    file was made by hand, not by a crash, so the run stops and says so)."""


class HFFormatError(UserError):
    """A Hugging Face checkpoint or config, or a weights directory, that cannot be read into our model."""


class HostError(UserError):
    """A setting of one host (its environment, its network) that is wrong there: every host of a
    job says it for itself, through its first process, not only rank 0's."""


class UsageError(UserError):
    """A command-line argument with a value that is not allowed."""


def install_hint(extra: str) -> str:
    """The command that installs the package's extra ``extra`` (setup.py's ``extras_require``) into
    this interpreter. moe_dist is installed from its checkout, not from a package index, so the
    command names the checkout this module was loaded from; elsewhere, what to run in a checkout."""
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(root, "setup.py")):
        return f"{sys.executable} -m pip install -e '{root}[{extra}]'"
    return f"EXTRAS=dev,{extra} bash scripts/setup.sh (in a moe_dist checkout)"
