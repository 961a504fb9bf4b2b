"""The few errors the program turns into one-line messages (exit code 2) in cli.py."""


class LocalchatError(Exception):
    """A user-facing error: the message is one line saying what is wrong and how to fix it."""


class ProfileError(LocalchatError):
    pass


class ModelError(LocalchatError):
    pass


class SessionError(LocalchatError):
    pass


class ContextFullError(LocalchatError):
    pass
