"""The front door to the engine: the thread that owns it, the composition of a chat from a profile and a
session choice, and `Host`, whose methods are what any front end asks of a chat."""
