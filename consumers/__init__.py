"""Built-in consumers, registered through the same pluggy hook as third-party ones."""
