"""The terminal UI and line mode: the scheduler that owns the engine between turns, slash commands, the live view,
the status bar, the clipboard."""
