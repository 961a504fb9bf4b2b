"""One conversation over one engine: its messages and tokens, each turn's delta, read-ahead and the official form,
overflow, the reply stream, attachments, the turn's record."""
