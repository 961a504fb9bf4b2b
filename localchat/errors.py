"""The few errors the program turns into one-line messages (exit code 2) in cli.py."""


class LocalchatError(Exception):
    """A user-facing error: the message is one line saying what is wrong and how to fix it."""


class ProfileError(LocalchatError):
    pass


class UsageError(LocalchatError):
    """A command line that cannot mean what it says (a one-word prompt that is a misspelt command)."""


class ModelError(LocalchatError):
    pass


class SessionError(LocalchatError):
    pass


class ContextFullError(LocalchatError):
    pass


class DocumentError(LocalchatError):
    """A file that cannot be attached; the message names it and says why."""


class TemplateFailure(ModelError):
    """The model's chat template broke a bound, the sandbox or its own rules: at load the chat
    does not start; during a chat the turn ends with the message (line mode exits 2)."""

    def __init__(self, message: str, kind: str = "template"):
        super().__init__(message)
        self.kind = kind  # bound, sandbox, template (its own raise_exception), syntax


class DamagedModel(ModelError):
    """The model file loaded but computes nonsense (non-finite logits): the chat cannot go on with it."""


class ChatEnded(LocalchatError):
    """The chat cannot go on in this process (its model could not be loaded again); what was said is
    saved. Both UIs end with the message and exit code 2."""


class ToolsUnsupported(LocalchatError):
    """Tools were asked for and the model's template takes none; the message names the model."""


class RequestError(LocalchatError):
    """A front end's request the chat cannot take as it is (a message list that is no delta of the chat)."""
