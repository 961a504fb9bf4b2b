"""`localchat bench`: every benchmark, the peers it measures against, the scripted terminal. Only the command
dispatcher imports it."""
