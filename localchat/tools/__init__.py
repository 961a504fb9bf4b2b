"""Tool runners: the built-in tools rooted at the working directory; they know nothing of a chat."""
