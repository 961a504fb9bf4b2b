"""The terminal UI and line mode, clients of `host.Host`: slash commands, the live view,
the status bar, the clipboard."""
