"""Commands that drive other commands: `ttt suite` and the data it prepares."""
